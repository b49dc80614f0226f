"""eagle-ray: EAGLE-2/3 speculative decoding with batched dynamic trees, for Ray Data and Ray Serve.

The names below load on first use (PEP 562): a process that imports one of the package's modules (a job's driver, a
Ray Data task) does not import torch and transformers unless it builds an engine (which imports neither
transformers' model code nor torch's compiler: see model/decoder.py)."""
import importlib

_WHERE = {"ProcessorConfig": "eagle_ray.batch.processor", "build_processor": "eagle_ray.batch.processor",
          "EngineConfig": "eagle_ray.config", "SamplingParams": "eagle_ray.config", "TreeConfig": "eagle_ray.config",
          "EagleEngine": "eagle_ray.engine.engine", "RequestOutput": "eagle_ray.engine.engine",
          "CheckpointError": "eagle_ray.errors", "ConfigError": "eagle_ray.errors", "EagleError": "eagle_ray.errors",
          "InvalidRequestError": "eagle_ray.errors", "PromptTooLongError": "eagle_ray.errors"}
__all__ = list(_WHERE)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'eagle_ray' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
