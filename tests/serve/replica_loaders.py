"""Model loaders that Ray Serve replicas import by name (tests/serve is on the workers' PYTHONPATH)."""


def broken_model():
    raise FileNotFoundError("no weights in /nowhere")
