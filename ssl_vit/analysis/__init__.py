"""Looking inside the model: the ViT paper's figures (Dosovitskiy et al. 2021, §4.5, Figs. 6-7,
Appendix D.7-D.8) and DINO's attention maps (Caron et al. 2021, Fig. 3), each computed by a pure
function returning tensors and drawn separately with matplotlib.

    embedding   principal components of the patch embedding E; position-embedding similarity
    attention   mean attention distance, attention rollout, DINO's per-head [CLS] maps and masks
    draw        the figures
    render      every figure at once: ``compute_all``, ``plot_all``, ``save_all``, ``render_all``
    callback    ``AnalysisCallback``: the figures in TensorBoard while training
"""

from ssl_vit.analysis.callback import AnalysisCallback
from ssl_vit.analysis.render import FIGURES, compute_all, plot_all, render_all, save_all

__all__ = ["FIGURES", "AnalysisCallback", "compute_all", "plot_all", "render_all", "save_all"]
