"""The ``moecompress`` command line: thin Click commands over the library."""
