"""Looking inside the model: the ViT paper's figures (Dosovitskiy et al. 2021, §4.5, Figs. 6-7,
Appendix D.7-D.8) and DINO's attention maps (Caron et al. 2021, Fig. 3), each computed by a pure
function returning tensors (``embedding``: filters and position embeddings; ``attention``) and drawn
separately with matplotlib (``draw``); ``render`` makes every figure at once, ``AnalysisCallback``
while training, in TensorBoard."""

from ssl_vit.analysis.callback import AnalysisCallback
from ssl_vit.analysis.render import FIGURES, compute_all, plot_all, render_all, save_all

__all__ = ["FIGURES", "AnalysisCallback", "compute_all", "plot_all", "render_all", "save_all"]
