"""caspo: reinforcement learning of language models on verifiable math, every credit-assignment method
under one trainer (DESIGN.md)."""


def __getattr__(name: str):
    if name == "__version__":  # read when asked: importing caspo (as every reward worker does) stays light
        from importlib.metadata import version

        return version("caspo")
    raise AttributeError(f"module 'caspo' has no attribute {name!r}")
