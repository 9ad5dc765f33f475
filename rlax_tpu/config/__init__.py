"""Typed run configuration: one frozen, keyword-only dataclass per component.

Each section lives in its own module here (``model``, ``mesh``, ``trainer``, ``inference``,
``param_server``, ``verifiers``, ``data``, ``algorithm``, ``environment``, ``controller``,
``topology``), with its fields, their comments (the flag reference is generated from them) and
its own validation; ``run`` assembles them into :class:`RunConfig` with the rules that span
sections.

Config files (``configs/*.py``) build an ``ml_collections.ConfigDict`` from :func:`base_config_dict`,
edit it, and the command line may override fields (``--config.trainer.learning_rate=3e-6``). The
result is turned into a :class:`RunConfig` by :func:`from_dict` (``convert``), which rejects unknown
keys, wrong types, out-of-range values and inconsistent combinations. Every error names the dotted
field path and says why, e.g. ``trainer.learning_rate = -1.0: must be > 0``.
"""

from rlax_tpu.config.algorithm import (
    ALGORITHMS,
    GROUP_ALGORITHMS,
    REWARDS,
    AlgorithmConfig,
    known_algorithms,
    known_rewards,
    register_algorithm_name,
    register_reward_name,
)
from rlax_tpu.config.checks import UNBOUNDED, ConfigError, detect_accelerator
from rlax_tpu.config.controller import ControllerConfig
from rlax_tpu.config.convert import BUCKET, base_config_dict, diff, from_dict, to_dict
from rlax_tpu.config.data import DataConfig
from rlax_tpu.config.environment import (
    ENVIRONMENTS,
    EnvironmentConfig,
    known_environments,
    register_environment_name,
)
from rlax_tpu.config.inference import InferenceConfig
from rlax_tpu.config.mesh import DistributedConfig, MeshConfig
from rlax_tpu.config.model import ModelConfig
from rlax_tpu.config.observability import (
    SINKS,
    ObservabilityConfig,
    WandbConfig,
    known_sinks,
    register_sink_name,
)
from rlax_tpu.config.param_server import ParamServerConfig
from rlax_tpu.config.run import RunConfig
from rlax_tpu.config.topology import TopologyConfig
from rlax_tpu.config.trainer import TrainerConfig
from rlax_tpu.config.verifiers import LANGUAGES, VerifierConfig

__all__ = [
    "ALGORITHMS",
    "BUCKET",
    "GROUP_ALGORITHMS",
    "LANGUAGES",
    "REWARDS",
    "SINKS",
    "UNBOUNDED",
    "AlgorithmConfig",
    "ConfigError",
    "ControllerConfig",
    "DataConfig",
    "DistributedConfig",
    "ENVIRONMENTS",
    "EnvironmentConfig",
    "InferenceConfig",
    "MeshConfig",
    "ModelConfig",
    "ObservabilityConfig",
    "ParamServerConfig",
    "RunConfig",
    "TopologyConfig",
    "TrainerConfig",
    "VerifierConfig",
    "WandbConfig",
    "base_config_dict",
    "detect_accelerator",
    "diff",
    "from_dict",
    "known_algorithms",
    "known_environments",
    "known_rewards",
    "known_sinks",
    "register_algorithm_name",
    "register_environment_name",
    "register_reward_name",
    "register_sink_name",
    "to_dict",
]
