"""RunConfig: every section, and the rules that span them."""

from __future__ import annotations

import dataclasses
from typing import Literal

from rlax_tpu.config.algorithm import AlgorithmConfig
from rlax_tpu.config.checks import UNBOUNDED, ConfigError, frozen
from rlax_tpu.config.controller import ControllerConfig
from rlax_tpu.config.data import DataConfig
from rlax_tpu.config.environment import EnvironmentConfig
from rlax_tpu.config.inference import InferenceConfig
from rlax_tpu.config.mesh import MeshConfig
from rlax_tpu.config.model import ModelConfig
from rlax_tpu.config.observability import ObservabilityConfig
from rlax_tpu.config.param_server import ParamServerConfig
from rlax_tpu.config.topology import TopologyConfig
from rlax_tpu.config.trainer import TrainerConfig
from rlax_tpu.config.verifiers import VerifierConfig

# Built-in algorithms whose advantage is a recursion over a completion's tokens (GAE,
# returns-to-go): multi-turn episodes leave holes in it (algorithms.batch.TOKEN_ORDER_ADVANTAGES).
TOKEN_ORDER_ALGORITHMS = ("ppo", "reinforce_pp")


@frozen
class RunConfig:
    preset: str = "default"  # the config file's preset this config came from (informational)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    inference: InferenceConfig = dataclasses.field(default_factory=InferenceConfig)
    param_server: ParamServerConfig = dataclasses.field(default_factory=ParamServerConfig)
    verifiers: VerifierConfig = dataclasses.field(default_factory=VerifierConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    controller: ControllerConfig = dataclasses.field(default_factory=ControllerConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    environment: EnvironmentConfig = dataclasses.field(default_factory=EnvironmentConfig)
    topology: TopologyConfig = dataclasses.field(default_factory=TopologyConfig)
    observability: ObservabilityConfig = dataclasses.field(default_factory=ObservabilityConfig)

    def __post_init__(self) -> None:
        """Rules that span components."""
        inf, model, ctl, alg = self.inference, self.model, self.controller, self.algorithm
        needed = inf.max_prompt_len + inf.max_new_tokens
        if needed > model.max_position_embeddings:
            raise ConfigError(
                "inference.max_new_tokens",
                f"max_prompt_len + max_new_tokens = {needed} exceeds "
                f"model.max_position_embeddings ({model.max_position_embeddings})",
                inf.max_new_tokens,
            )
        batch = ctl.prompts_per_step * alg.group_size
        if batch % self.trainer.micro_batch_size:
            raise ConfigError(
                "trainer.micro_batch_size",
                "must divide the rollouts per step "
                f"(controller.prompts_per_step * algorithm.group_size = {batch})",
                self.trainer.micro_batch_size,
            )
        for name, mesh in (("mesh", self.mesh), ("inference.mesh", inf.mesh)):
            tp, kv = mesh.tensor, model.num_kv_heads
            if tp != -1 and (model.num_heads % tp or (kv % tp and tp % kv)):
                raise ConfigError(
                    f"{name}.tensor",
                    f"must divide model.num_heads ({model.num_heads}) and divide or be a "
                    f"multiple of model.num_kv_heads ({kv})",
                    tp,
                )
        rows, data = inf.step_tokens or inf.max_concurrent_seqs, inf.mesh.data
        if data > 1 and alg.group_size > rows // data:
            raise ConfigError(
                "algorithm.group_size",
                f"a group's samples share their prompt's pages on one of the engine's {data} data "
                f"shards, one decode row each: at most step_tokens / inference.mesh.data = "
                f"{rows // data} (step_tokens 0: max_concurrent_seqs)",
                alg.group_size,
            )
        if alg.router_aux_loss_coef and not model.num_experts:
            raise ConfigError(
                "algorithm.router_aux_loss_coef",
                "balances a mixture of experts' routing: the model has no experts",
                alg.router_aux_loss_coef,
            )
        for name, m in (("mesh", self.mesh), ("inference.mesh", inf.mesh)):
            if m.expert > 1 and model.num_experts % m.expert:
                raise ConfigError(
                    f"{name}.expert",
                    f"must divide the model's {model.num_experts} experts (each device holds an "
                    "equal share)",
                    m.expert,
                )
        if inf.mesh.expert > 1 and not model.num_experts:
            # For a dense model the axis is one more fsdp: decode would gather the weights.
            raise ConfigError(
                "inference.mesh.expert",
                "splits a mixture of experts' experts: the model has none (a worker would "
                "all-gather its weights at every decode step); split them over tensor",
                inf.mesh.expert,
            )
        if self.trainer.routing_replay != "off" and not model.num_experts:
            raise ConfigError(
                "trainer.routing_replay",
                "replays a mixture of experts' routing: the model has no experts",
                self.trainer.routing_replay,
            )
        self._check_slices()
        self._check_environment()
        self.observability.check_sinks()
        obs = self.observability
        if "wandb" in obs.sinks and not obs.wandb.dir and ctl.run_dir.startswith("gs://"):
            raise ConfigError(
                "observability.wandb.dir",
                "a gs:// run directory needs a local directory for W&B's files (W&B writes "
                "through the local file system; its online mode uploads them as it goes)",
                obs.wandb.dir,
            )
        self._check_gguf_per_host()
        replicas = self.param_server.replicas
        if ctl.param_server_endpoints and len(ctl.param_server_endpoints) != replicas:
            raise ConfigError(
                "controller.param_server_endpoints",
                f"needs one endpoint per replica (param_server.replicas = {replicas}): a replica "
                "nobody publishes to never confirms progress, so no replica could collect versions",
                ctl.param_server_endpoints,
            )
        if inf.param_server_replica >= replicas:
            raise ConfigError(
                "inference.param_server_replica",
                f"must be < param_server.replicas ({replicas})",
                inf.param_server_replica,
            )
        if ctl.snapshot_keep < self.trainer.checkpoint_every + 1:
            raise ConfigError(
                "controller.snapshot_keep",
                "a resume needs a snapshot whose version has a trainer checkpoint: keep at least "
                f"trainer.checkpoint_every + 1 = {self.trainer.checkpoint_every + 1}",
                ctl.snapshot_keep,
            )
        span = self.trainer.keep_checkpoints * self.trainer.checkpoint_every
        if ctl.snapshot_keep > span:
            raise ConfigError(
                "controller.snapshot_keep",
                f"the oldest of {ctl.snapshot_keep} snapshots would be older than every kept "
                f"trainer checkpoint (trainer.keep_checkpoints {self.trainer.keep_checkpoints} x "
                f"checkpoint_every {self.trainer.checkpoint_every} = {span} steps), so no resume "
                f"could use it: keep at most {span} snapshots or more checkpoints",
                ctl.snapshot_keep,
            )
        needed_versions = ctl.pipeline_depth * (ctl.mode == "deterministic") + ctl.reload_staleness
        if ctl.transport == "local" and self.trainer.keep_checkpoints < needed_versions:
            raise ConfigError(
                "trainer.keep_checkpoints",
                "with the local transport a resumed run republishes the versions its unfinished "
                "work was generated with from the trainer's checkpoints: keep at least "
                f"pipeline_depth + reload_staleness = {needed_versions}",
                self.trainer.keep_checkpoints,
            )
        if self.inference.span_groups >= 2 and self.trainer.align_logprobs:
            raise ConfigError(
                "inference.span_groups",
                "span groups change the engine's f32 rounding with the batch, so the trainer's "
                "replay cannot reproduce its log-probs bitwise; set trainer.align_logprobs = False "
                "or span_groups = 0",
                self.inference.span_groups,
            )
        if self.topology.trainer_devices:
            if ctl.transport != "local" or ctl.trainer_process:
                raise ConfigError(
                    "topology.trainer_devices",
                    "splits one process's devices: it needs controller.transport 'local' and "
                    "trainer_process False",
                    self.topology.trainer_devices,
                )
            if -1 in inf.mesh.sizes:
                raise ConfigError(
                    "inference.mesh",
                    "needs explicit sizes (no -1) when topology.trainer_devices splits the devices",
                    inf.mesh.sizes,
                )
        if self.data.language not in self.verifiers.languages:
            raise ConfigError(
                "data.language",
                f"the verifiers do not run it (verifiers.languages = {self.verifiers.languages})",
                self.data.language,
            )
        if (
            self.data.replay
            and ctl.acceptance_staleness == UNBOUNDED
            and ctl.mode == "deterministic"
        ):
            raise ConfigError(
                "data.replay",
                "replay with unbounded staleness draws from an unbounded past, which "
                "deterministic mode cannot schedule; use mode 'throughput'",
                True,
            )
        if inf.overlap_reload and ctl.mode != "throughput":
            raise ConfigError(
                "inference.overlap_reload",
                "overlapped reloads need controller.mode 'throughput': deterministic mode runs "
                "one job at a time on a worker",
                True,
            )
        if inf.continue_on_reload and ctl.mode != "throughput":
            raise ConfigError(
                "inference.continue_on_reload",
                "partial rollouts need controller.mode 'throughput': deterministic mode generates "
                "every step with one version and never reloads a worker under a running job",
                True,
            )

    @property
    def rollouts_per_step(self) -> int:
        return self.controller.prompts_per_step * self.algorithm.group_size

    @property
    def relays_while_pushed(self) -> bool:
        """The workers fetch a reload point while the trainer still pushes it: the parameter
        server relays it as it arrives (``param_server.fanout`` "relay", over gRPC) and the
        controller learns of the push as it starts (``trainer.publish_in_flight``)."""
        return (
            self.param_server.fanout == "relay"
            and self.controller.transport == "distributed"
            and self.trainer.publish_in_flight > 0
        )

    @property
    def prompt_style(self) -> Literal["raw", "chat"]:
        """data.prompt_style with "auto" resolved: raw for a randomly initialized model (it has
        no chat format to follow), chat for pretrained weights."""
        if self.data.prompt_style != "auto":
            return self.data.prompt_style
        return "raw" if self.model.weights_format == "init" else "chat"

    def _check_environment(self) -> None:
        env = self.environment
        env.check_name()
        if env.name == "none":
            return
        if self.data.prompt_style != "chat":  # 'auto' may turn out raw: say it up front
            raise ConfigError(
                "data.prompt_style",
                "an environment's replies are turns of the model's chat template: use 'chat'",
                self.data.prompt_style,
            )
        if env.turn_tokens > self.inference.max_new_tokens:
            raise ConfigError(
                "environment.turn_tokens",
                f"exceeds the episode's budget inference.max_new_tokens "
                f"({self.inference.max_new_tokens})",
                env.turn_tokens,
            )
        if self.algorithm.name in TOKEN_ORDER_ALGORITHMS:
            raise ConfigError(
                "algorithm.name",
                "its advantage walks each completion's tokens in order, and an episode's "
                "completion holds the environment's tokens between the model's turns; choose "
                "one without (grpo, dapo, rloo, ...)",
                self.algorithm.name,
            )

    def _check_gguf_per_host(self) -> None:
        """A GGUF file is read from a local copy (it is memory-mapped): on gs:// every host of a
        multi-host trainer or worker would download all of it, where safetensors are read in
        place, each host about its share."""
        model = self.model
        gguf = [
            (name, path)
            for name, path, is_gguf in (
                ("model.weights_path", model.weights_path, model.weights_format == "gguf"),
                (
                    "model.tokenizer_path",
                    model.tokenizer_path,
                    model.tokenizer_path.endswith(".gguf"),
                ),
            )
            if is_gguf and path.startswith("gs://")
        ]
        hosts = {
            "trainer": self.trainer.distributed.num_processes,
            "inference": self.inference.distributed.num_processes,
        }
        many = [f"{k}.distributed.num_processes = {n}" for k, n in hosts.items() if n > 1]
        if gguf and many:
            name, path = gguf[0]
            raise ConfigError(
                name,
                f"a GGUF file on gs:// would be copied whole to every host ({', '.join(many)}); "
                "convert it once to an HF safetensors directory (read in place, each host its "
                "share), e.g. transformers' from_pretrained(..., gguf_file=...).save_pretrained"
                "(DIR), or give each host a local copy",
                path,
            )

    def _check_slices(self) -> None:
        """Multislice is the trainer's: an inference worker runs on one slice, and a trainer's
        processes split evenly over its slices."""
        if self.inference.mesh.slices != 1:
            raise ConfigError(
                "inference.mesh.slices",
                "must be 1: an inference worker runs on one slice (more workers scale inference)",
                self.inference.mesh.slices,
            )
        if self.inference.distributed.slice_index:
            raise ConfigError(
                "inference.distributed.slice_index",
                "must be 0: an inference worker runs on one slice",
                self.inference.distributed.slice_index,
            )
        slices, dist = self.mesh.slices, self.trainer.distributed
        if slices == 1 and dist.slice_index:
            raise ConfigError(
                "trainer.distributed.slice_index",
                "must be 0 with mesh.slices = 1",
                dist.slice_index,
            )
        if slices > 1 and dist.enabled:
            if dist.num_processes % slices:
                raise ConfigError(
                    "trainer.distributed.num_processes",
                    f"must split evenly over mesh.slices = {slices} (processes per slice)",
                    dist.num_processes,
                )
            if dist.slice_index >= slices or dist.job_process_id(slices) >= dist.num_processes:
                raise ConfigError(
                    "trainer.distributed.slice_index",
                    f"slice {dist.slice_index}, process {dist.process_id} is not one of the "
                    f"{dist.num_processes} processes over {slices} slices",
                    dist.slice_index,
                )


def check_runnable(config: RunConfig) -> None:
    """Rules a whole run needs that a component built alone does not (the command-line entry
    points check them at start-up; a trainer or engine made in code may differ on purpose)."""
    model, published = config.model, config.trainer.publish_dtype
    if model.lora_rank == 0 and published != model.param_dtype:
        # The engine holds model.param_dtype and takes only that (LoRA publishes float32
        # adapters whatever the setting): every load of the first version would be refused,
        # each worker marked down in turn, long after start-up.
        raise ConfigError(
            "trainer.publish_dtype",
            f"the workers hold model.param_dtype {model.param_dtype!r} and would refuse every "
            f"version published as {published!r}; set trainer.publish_dtype = "
            f"{model.param_dtype!r} (or model.param_dtype = {published!r})",
            published,
        )


def handoff_versions(config: RunConfig) -> int:
    """Versions the trainer keeps on its devices for the workers of its own process
    (``param_server.device_versions``, controller/handoff.py): with the local transport, the
    trainer in the controller's process and one trainer process; else 0."""
    c = config.controller
    if c.transport != "local" or c.trainer_process or config.trainer.distributed.num_processes > 1:
        return 0
    return config.param_server.device_versions
