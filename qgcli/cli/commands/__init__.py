"""The CLI commands, one module per command family. Modules import only click at import time."""
