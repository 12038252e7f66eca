"""How a quantised checkpoint is laid out on disk: the native format and the exports that need no plugin."""
