"""``python -m oncely`` runs the command line."""

from oncely.cli import main

main()
