import os


def output_path(path: str) -> str:
    """``path``, its folder made first: the documented commands write under results/, which a checkout lacks."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path
