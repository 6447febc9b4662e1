"""One module per ``msdist`` command: each computes plain data and hands it to ``mscli.render``."""
