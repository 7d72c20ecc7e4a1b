"""gpuledger: the command-line root that mounts every part's sub-commands, and the demo."""

__version__ = "0.1.0"
