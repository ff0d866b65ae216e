"""The one-off analyses the results cite (README.md here): ``python -m scripts.analysis.<name>`` from the repository root."""
