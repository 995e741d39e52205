"""The example model of examples/train_llama.py, for the benchmarks (examples/ is not a package)."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_train_llama():
    """examples/train_llama.py as a module: Llama, synthetic_batch, ..."""
    spec = importlib.util.spec_from_file_location("train_llama", ROOT / "examples" / "train_llama.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
