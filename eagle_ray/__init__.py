"""eagle-ray: EAGLE-2/3 speculative decoding with batched dynamic trees, for Ray Data and Ray Serve."""
from eagle_ray.batch.processor import ProcessorConfig, build_processor
from eagle_ray.config import EngineConfig, SamplingParams, TreeConfig
from eagle_ray.engine.engine import EagleEngine, RequestOutput
from eagle_ray.errors import CheckpointError, ConfigError, EagleError, InvalidRequestError, PromptTooLongError

__all__ = ["EagleEngine", "RequestOutput", "SamplingParams", "TreeConfig", "EngineConfig", "build_processor",
           "ProcessorConfig", "EagleError", "ConfigError", "CheckpointError", "InvalidRequestError",
           "PromptTooLongError"]
__version__ = "0.1.0"
