import sys

from ssl_vit.cli import main

sys.exit(main())
