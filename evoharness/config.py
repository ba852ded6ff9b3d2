"""One documented config dataclass per pipeline stage, filled from a profile YAML.

The layout follows TRL's config classes (e.g. ``trl/trainer/grpo_config.py``): each field has a type, a
default and a meaning. A profile (``profiles/<name>.yaml``) overrides the defaults per stage; the resolved
config is logged with every run (``PipelineConfig.to_dict``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"
# Product profiles lie in ``profiles/``; the records of past experiments, still loadable by name, in
# ``profiles/experiments/``. A name is looked up in that order.
PROFILE_DIRS = (PROFILES_DIR, PROFILES_DIR / "experiments")


def profile_path(name: str) -> Path:
    """The YAML file of profile ``name``: ``profiles/<name>.yaml``, else ``profiles/experiments/<name>.yaml``; the
    first candidate when neither exists (the caller reports it missing)."""
    candidates = [d / f"{name}.yaml" for d in PROFILE_DIRS]
    return next((c for c in candidates if c.exists()), candidates[0])


def known_profiles() -> list[str]:
    """Every profile name, product and experiment, sorted."""
    return sorted({p.stem for d in PROFILE_DIRS for p in d.glob("*.yaml")})


@dataclass
class CollectConfig:
    """Raw execution-log collection with ALFWorld's handcoded expert.

    Parameters:
        split: ALFWorld split whose games are played (``train``).
        num_games: how many games of the split (sorted by path, then every ``stride``-th); 0 means all.
        max_steps: environment steps per episode before it ends unwon.
        perturb_share: share of episodes (0..1) that take non-expert actions at random steps, so the logs hold
            failed commands ("Nothing happens.") and recoveries.
        perturb_step_prob: in a perturbed episode, probability per step of a non-expert action.
        invalid_share: among non-expert actions, share that are invalid commands (the pre-2025
            ``put X in/on Y`` phrasing of a ``move`` command, or a misspelt object) instead of random admissible ones.
        seed: base seed; each episode's seed derives from it and the game path, so logs are byte-identical.
        workers: worker processes (0 = all cores). Workers are recycled every ``games_per_worker`` games
            because TextWorld's reset leaks memory.
        games_per_worker: games a worker plays before it is replaced.
        episode_timeout_s: wall seconds per episode before it is recorded as failed (expert stall).
        shard_size: episodes per JSONL shard.
        path: the DVC-tracked folder the logs go to, relative to the repo (its ``.dvc`` file is ``<path>.dvc``).
            ``workers`` and ``path`` do not change the logs' bytes, so they are left out of the manifest.
    """

    NON_CONTENT = ("workers", "path")

    split: str = "train"
    num_games: int = 24
    stride: int = 1
    max_steps: int = 50
    perturb_share: float = 0.25
    perturb_step_prob: float = 0.15
    invalid_share: float = 0.5
    seed: int = 1234
    workers: int = 0
    games_per_worker: int = 25
    episode_timeout_s: float = 120.0
    shard_size: int = 500
    path: str = "data"

    def content_settings(self) -> dict:
        """The settings that decide the logs' bytes (recorded in the manifest; key of the resume folder)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in self.NON_CONTENT} | {"workers": None}


@dataclass
class IngestConfig:
    """Reading the raw logs. ``on_error``: ``stop`` (the first bad record raises, naming file, line and field) or
    ``quarantine`` (bad records, and the rest of their episodes, go to a side file and are counted in MLflow).
    ``dagger``: DVC-tracked folders of expert-labelled policy episodes (``python -m flows.dagger``) aggregated with
    the expert logs of ``collect.path`` (DAgger's dataset aggregation)."""

    on_error: str = "stop"
    dagger: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.on_error not in ("stop", "quarantine"):
            raise ValueError(f"ingest.on_error is {self.on_error!r}; use 'stop' or 'quarantine'")


@dataclass
class CostConfig:
    """The harness cost model and the reward GRPO trains on, in reward units (``evoharness.training.reward``).

    ``mode`` picks the reward. ``priced`` (the default): reward = won - cost, where cost = sum over executed
    meta-actions of ``per_call[type]`` + ``per_call_token`` * tokens of the call's arguments and result
    + ``per_generated_token`` * tokens the policy generated in the episode + ``per_rejected_turn`` * turns the harness
    rejected. Environment actions cost nothing beyond their generated tokens.

    A rejected turn is a malformed one (output that parses as no tool call, even when score decoding still turns it
    into an admissible act), a call to an unknown tool, a meta-action whose arguments fail its schema, or a
    meta-action refused because the episode's meta-action budget is spent. Without this price a malformed turn costs
    only its tokens (issue 6's first run: 0.1 -> 28.8 malformed turns per episode in 12 steps). The default is the
    dearest ``per_call``, so a rejected call is never cheaper than an executed one. It does not stop the drift on its
    own: at 0.03 and no KL term malformed turns still rose to 38 per episode by step 8 (README, issue 6).

    ``budget``: the paper's reward (EvoHarness-RL, arXiv:2608.05446; ``evoharness.training.reward`` defines every term).
    Meta-actions spend the same interaction budget as environment actions and the priced cost above is computed and
    logged but not charged. Its weights, with the defaults of the paper's ALFWorld GRPO run (its
    ``configs/train/common.yaml`` ``reward_shaping`` and ``env`` sections, ``configs/train/alfworld.yaml``):

    - ``task_reward`` (10.0, ``env.success_reward``): reward of a won episode.
    - ``interaction_budget`` (T_max, 70, ``env.max_steps`` of the ALFWorld run; ``RewardConfig.max_steps`` is 50
      only when no environment horizon is given): the episode's budget of environment actions plus meta-action
      calls in training, and the horizon of the efficiency term.
    - ``lambda_eff`` (1.0): weight of ``1[won] * (T_max - |tau|) / T_max``.
    - ``lambda_div0`` (1.0, ``lambda_div_max``) and ``anneal_updates`` (U, 150: ``trainer.total_epochs``, which the
      paper's ``anneal_updates`` defaults to): the diversity weight, cosine-annealed from ``lambda_div0`` at GRPO
      step 0 to 0 at step U.
    - ``lambda_spam`` (0.1) and ``spam_cap`` (C_spam, 10): the price of a repeated call, at most ``spam_cap`` of them.
    - ``lambda_inv`` (0.1, ``lambda_invalid``): the price of an invalid action.
    - ``charge_meta_actions`` (True, ``env.harness.charge_meta_actions`` in training): meta-action calls spend the
      budget; False charges environment actions only (the paper's evaluation setting), for the ablation that turns
      the budget charge off.
    - ``charge_priced`` (False; not in the paper): also charge the priced cost above (``per_call`` for each executed
      meta-action, the token prices, ``per_rejected_turn``) on top of the budget reward, a per-call price the policy
      sees at every call instead of only through the efficiency term of a won episode. Its prices are in the
      budget reward's units, where a win is ``task_reward``.
    """

    MODES = ("priced", "budget")

    per_call: dict[str, float] = field(
        default_factory=lambda: {"track": 0.02, "commit": 0.02, "recall": 0.03, "note": 0.03}
    )
    per_call_token: float = 0.0005
    per_generated_token: float = 0.0002
    per_rejected_turn: float = 0.03
    mode: str = "priced"
    task_reward: float = 10.0
    interaction_budget: int = 70
    lambda_eff: float = 1.0
    lambda_div0: float = 1.0
    anneal_updates: int = 150
    lambda_spam: float = 0.1
    spam_cap: int = 10
    lambda_inv: float = 0.1
    charge_meta_actions: bool = True
    charge_priced: bool = False

    def __post_init__(self):
        if self.mode not in self.MODES:
            raise ValueError(f"cost.mode is {self.mode!r}; use one of {list(self.MODES)}")
        if self.interaction_budget < 1 or self.anneal_updates < 1:
            raise ValueError(f"cost.interaction_budget ({self.interaction_budget}) and cost.anneal_updates "
                             f"({self.anneal_updates}) must be at least 1")
        if self.spam_cap < 0:
            raise ValueError(f"cost.spam_cap is {self.spam_cap}; use 0 or more")

    # the budget reward's fields, added after evaluations were recorded: in ``priced`` mode they charge nothing, so
    # an evaluation's identity leaves them out and older evaluation folders still resume
    BUDGET_FIELDS = ("mode", "task_reward", "interaction_budget", "lambda_eff", "lambda_div0", "anneal_updates",
                     "lambda_spam", "spam_cap", "lambda_inv", "charge_meta_actions", "charge_priced")

    def identity(self) -> dict:
        """The fields that change what an evaluation charges: all of them in ``budget`` mode, the priced ones in
        ``priced`` mode (``dataclasses.asdict`` less ``BUDGET_FIELDS``)."""
        values = dataclasses.asdict(self)
        return values if self.mode != "priced" else {k: v for k, v in values.items() if k not in self.BUDGET_FIELDS}


@dataclass
class TraceConfig:
    """BPE trace construction from raw episodes.

    Parameters:
        won_only: build SFT traces only from won episodes (filtered behaviour cloning); every episode still
            feeds the Experience store through ``note``.
        recall_top_k: lessons a ``recall`` returns.
        max_belief_facts: Belief entries kept in the rendered workspace.
        render_budget_tokens: the rendered workspace's budget (whitespace tokens).
        valid_share: share of games held out as the trace dataset's validation split (split by game).
        context: ``history`` (one growing conversation per episode: the layout GRPO trains on) or ``turn`` (each
            turn a fresh compact prompt built by ``evoharness.harness.context.TurnView``; one SFT example per turn).
        harness: with False the traces hold no meta-action and the prompt no workspace: the plain
            observation/action baseline (``turn`` context only).
        recent_actions: ``turn`` context: how many of the last commands the prompt lists.
        system_prompt: ``turn`` context: start each prompt with a short system message.
        tools_in_prompt: ``turn`` context: render the tool schemas into the prompt (the chat template's tools
            block, several hundred tokens per example); off for the embedded model, on for pretrained ones.
        drop_labels: ``turn`` context: commands that are never SFT targets (still shown as history): non-expert
            (random, invalid) commands of perturbed episodes always; and these expert commands: ALFWorld's expert
            wrapper answers ``look`` (sometimes ``inventory``) whenever its own next command is not admissible (field
            notes: ~11 % of labels).
        dagger_weight: ``turn`` context: how many times each DAgger episode's examples appear in the train split
            (``ingest.dagger``; they are a small share of the aggregate, and the states the policy reaches).
        parallel_calls: ``turn`` context with harness: a turn is the meta-actions the policy calls on what it just
            saw, then its ``act``, all in one assistant message (several ``<tool_call>`` blocks: Qwen3's parallel
            tool-call format). One SFT example per environment step instead of one per call, so a step of
            training covers as many episodes as the plain baseline's. False: one tool call per turn.
        lesson_turns: ``turn`` context: how many environment commands a ``recall``'s lessons stay in the prompt
            (``evoharness.harness.context.TurnView``); 0: the rest of the episode. 1 shows them until the next command,
            for fewer tokens per epoch (README item 16).
        track_searched: with harness, the teacher tracks ``<receptacle> searched=yes`` when an observation lists a
            receptacle's contents without a task object (about 30 % of the ``full`` examples). False leaves those
            calls out: Belief then holds object locations, the inventory and object states only, and an epoch costs
            fewer tokens (no call in the completion, no fact in later prompts; README item 17).
        call_dropout: with harness, the share of the teacher's ``track`` and ``commit`` calls left out, by name
            (e.g. ``{track: 0.5, commit: 0.5}``), drawn per call from a generator seeded by the episode id. A teacher
            that calls on a fixed rule makes a nearly deterministic policy (TRL's logged entropy 0.01-0.02 nats per
            token, journal item 25), whose GRPO rollouts never sample a turn without the call, so a price on calls
            has nothing to compare; here the SFT policy learns both branches at the states the rule fires on, and
            cost-aware GRPO chooses between them. A dropped call's fact is missing from later prompts, as at run
            time. A dropped ``commit``'s successor depends on the last subgoal committed. ``recall`` and ``note``
            carry Experience and always stay.
    """

    won_only: bool = True
    recall_top_k: int = 2
    max_belief_facts: int = 12
    render_budget_tokens: int = 160
    valid_share: float = 0.1
    context: str = "history"
    harness: bool = True
    recent_actions: int = 8
    system_prompt: bool = False
    tools_in_prompt: bool = False
    drop_labels: list[str] = field(default_factory=lambda: ["look", "inventory"])
    dagger_weight: int = 1
    parallel_calls: bool = False
    lesson_turns: int = 0
    track_searched: bool = True
    call_dropout: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        for name, share in self.call_dropout.items():
            if name not in ("track", "commit"):
                raise ValueError(f"traces.call_dropout names {name!r}; only 'track' and 'commit' calls can be left out "
                                 "('recall' and 'note' carry Experience)")
            if not 0.0 <= float(share) <= 1.0:
                raise ValueError(f"traces.call_dropout.{name} is {share}; use a share between 0 and 1")
        if self.lesson_turns < 0:
            raise ValueError(f"traces.lesson_turns is {self.lesson_turns}; use 0 (the rest of the episode) or more")
        if self.context not in ("history", "turn"):
            raise ValueError(f"traces.context is {self.context!r}; use 'history' or 'turn'")
        if self.dagger_weight < 1:
            raise ValueError(f"traces.dagger_weight is {self.dagger_weight}; use 1 or more (copies of each example)")
        if not self.harness and self.context != "turn":
            raise ValueError("traces.harness: false (the plain baseline) needs traces.context: turn")
        if self.parallel_calls and (self.context != "turn" or not self.harness):
            raise ValueError("traces.parallel_calls: true needs traces.context: turn and traces.harness: true")


# Pre-tokenizer pieces (``ModelConfig.pieces``), each then byte-level encoded:
# - ``words-apart``: a number or a punctuation run with its leading space, a whitespace run, a word. Unlike GPT-2's
#   byte-level regex (`` ?\p{L}+``), a word never carries its leading space, so "sidetable" is one token id in
#   "You arrive at sidetable 1." and in the tool call ``{"entity": "sidetable 1"}``, where it follows a quote. With
#   GPT-2's pieces the two are different ids ("Ġsidetable" / "sidetable") and a small model must learn the mapping
#   word by word before it can copy an observed name into a call; measured on the trace corpus, words-apart pieces
#   cost 34 % more tokens per example, most of them the single spaces between words.
# - ``trailing-space``: a word or a punctuation run with the one space after it, a number alone, a whitespace run.
#   A name keeps that property ("sidetable 1" is "sidetableĠ" + "1" in an observation and in a call), and the
#   spaces ride on the words: 19 % fewer tokens per example than words-apart on the ``full-parallel`` traces
#   (173 against 214 on 3,000 held-out examples, vocabulary 2,048; README item 17).
PIECES = {
    "words-apart": r" ?\d+| ?[^\s\w]+|\s+|\w+",
    "trailing-space": r"[^\W\d]+ ?|\d+|[^\s\w]+ ?|\s+",
}


@dataclass
class ModelConfig:
    """The policy model. ``path`` empty means the embedded default: a Qwen3-architecture model built from
    the sizes below with a byte-level BPE tokenizer trained on the traces; otherwise a release folder
    (``models/<name>``, ``evoharness.registry.release``), any local or hub path, or a registered version
    ``models:/NAME/VERSION`` that SFT trains further (an alias is refused: ValueError). A model that records its
    context layout (``evoharness_layout``) must be trained on traces of that layout (``traces``).
    ``from_champion``: start from the registered ``champion`` of ``registered_model_name`` when there is one, else
    from ``path`` (a release, registered first and made champion when it reaches ``promote.min_success``): the
    retraining job of the ``default`` profile.
    ``pieces``: the embedded tokenizer's pre-tokenizer, ``words-apart`` or ``trailing-space``
    (``PIECES``: the same names as token ids in observations and calls; trailing-space takes about
    19 % fewer tokens per example)."""

    path: str = ""
    from_champion: bool = False
    pieces: str = "words-apart"
    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 4096
    seed: int = 0

    def __post_init__(self):
        if self.pieces not in PIECES:
            raise ValueError(f"model.pieces is {self.pieces!r}; use one of {sorted(PIECES)}")
        if self.path.startswith("models:/") and "@" in self.path:
            raise ValueError(f"model.path is {self.path!r}: pin a version (models:/NAME/VERSION); an alias can move, "
                             "and the SFT stage's cache is keyed on this string")


@dataclass
class TrainingRuntime:
    """How a training stage runs, shared by SFT and GRPO: ``num_processes`` under ``accelerate launch`` with
    ``accelerate_config`` (empty: ``accelerate/cpu_<n>proc.yaml``), the weights' ``model_dtype`` when loaded,
    ``gradient_checkpointing``, and LoRA through peft when ``lora_r`` > 0 (``evoharness.training.model.lora_config``;
    the adapter is merged into the saved final model)."""

    num_processes: int = 1
    accelerate_config: str = ""
    model_dtype: str = "float32"
    gradient_checkpointing: bool = False
    lora_r: int = 0
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: str = "all-linear"


@dataclass
class SFTStageConfig(TrainingRuntime):
    """Supervised harness fine-tuning with TRL's ``SFTTrainer`` (loss on assistant turns / completions only).

    ``sampling`` is transformers' ``train_sampling_strategy``: ``random``, or ``group_by_length`` (batches of
    similar length: less padding, which matters on CPU with many short per-turn examples).

    Large pretrained models (``model.path``, e.g. ``Qwen/Qwen3-8B`` on GPUs) are set up here, not in code:
    ``model_dtype`` (the weights' dtype when loaded: ``bfloat16`` on GPUs), ``bf16`` (mixed precision; on CPUs with
    AVX512-BF16 or AMX it is autocast, on other CPUs the run trains in fp32 and records why:
    ``evoharness.training.sft.training_precision``), ``gradient_checkpointing``, and LoRA through peft when ``lora_r`` >
    0 (TRL's ``SFTTrainer(peft_config=LoraConfig(...))``; the adapter is merged into the saved final model so later
    stages load a plain model folder). ``accelerate_config``: the Accelerate config file (empty:
    ``accelerate/cpu_<n>proc.yaml`` for ``num_processes``; ``accelerate/fsdp_gpu.yaml`` for multi-GPU FSDP).

    ``torch_compile``: transformers' ``TrainingArguments.torch_compile`` (``torch.compile`` with the inductor
    backend, which on CPUs generates C++ kernels with the system compiler); the first steps pay for the compilation.
    Measure it with ``scripts/benchmark_sft.py`` before turning it on in a profile.

    ``time_budget_s`` (> 0; seconds of wall time, the calibration included) replaces ``max_steps`` by the steps that
    fit the budget on the machine that runs it: ``calibration_steps`` steps of the same recipe on a throwaway copy
    of the model measure the steady seconds a step, and ``max_steps = (budget - calibration) / (s a step x
    time_budget_margin)`` (the margin covers the slower steps later in a run and the validation pass); the cosine
    schedule is planned for those steps and training stops at the budget regardless
    (``evoharness.training.sft.TimeLimit``). The plan is saved with the checkpoints, so a resumed run keeps it.
    """

    num_train_epochs: float = 3.0
    max_steps: int = -1
    per_device_train_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    learning_rate: float = 2e-3
    warmup_ratio: float = 0.05
    max_length: int = 2048
    save_steps: int = 200
    logging_steps: int = 5
    sampling: str = "random"
    bf16: bool = False
    torch_compile: bool = False
    time_budget_s: float = 0.0
    calibration_steps: int = 60
    time_budget_margin: float = 1.08
    seed: int = 0


@dataclass
class GRPOStageConfig(TrainingRuntime):
    """Cost-aware GRPO with TRL's ``GRPOTrainer`` and a multi-turn ``rollout_func`` over ALFWorld games.

    Parameters:
        split / num_games: the games whose episodes form the groups.
        num_generations: episodes per game per step (the GRPO group).
        turns_per_episode: ``turn`` context only: turns drawn from each episode as GRPO samples, so a group holds
            ``num_generations x turns_per_episode`` samples (``evoharness.training.rollouts.TurnRollouts``). Ignored
            when ``turns_per_group`` is set.
        turns_per_group: ``turn`` context only; 0: off (``turns_per_episode`` turns sampled per episode, each
            carrying its episode's reward, and TRL normalises within the group). > 0: every turn of the group's
            ``num_generations`` episodes is a sample, each with its own advantage computed here
            (``evoharness.training.advantages.turn_advantages`` under ``advantage``) and passed to TRL unscaled
            (``scale_rewards="none"``); the group is padded to this many samples with masked rows (one of them
            makes the group's mean 0, so TRL's baseline leaves the advantages as computed), and a group with more
            turns than ``turns_per_group - 1`` trains on that many of them drawn uniformly (the rest are counted as
            ``turns_dropped`` in the step's metrics). Size it to the longest group expected:
            ``num_generations x`` the turn budget.
        advantage: with ``turns_per_group``: ``grpo`` (every turn gets its episode's group-relative advantage) or
            ``gigpo`` (plus the step-level advantage over turns that start from the same environment state: Feng et
            al. 2025, arXiv:2505.10978), with ``gigpo_gamma`` (discount of step returns) and ``gigpo_omega`` (weight
            of the step-level term): the paper's 0.95 and 1.
        max_steps: optimizer steps.
        micro_batch_size: samples per forward and backward pass; 0: a process's whole step at once. A step's
            samples (``prompts_per_step / num_processes`` groups per process) are split into passes of this many, the
            gradient accumulated over them, so a step is still one optimizer update on one generation batch (TRL's
            ``gradient_accumulation_steps`` and ``steps_per_generation``). Memory grows with it: every turn of 8
            episodes (``turns_per_group: 480``) in one pass of the 3.4M-parameter model took over 12 GiB per
            process. Must divide a process's samples per step.
        max_env_steps / max_meta_actions: per-episode budgets during rollouts.
        ground_track: ``turn`` context: a rollout's ``track`` names are drawn over the latest observation's names (at
            the rollout temperature, from the softmax of their log-likelihoods), as ``evaluate.ground_track`` plays
            them (``evoharness.policy.lm_policy.LMPolicy``). The drawn tokens are recorded with the model's own
            log-probabilities, as scored commands are.
        temperature: sampling temperature of rollouts (TRL scales the training logits by the same value). 0.7, not
            1.0: the default SFT model's first turns were malformed tool calls in 13 of 16 samples at 1.0, 6 of 16
            at 0.7, 0 of 4 greedy (4 train games).
        beta: KL coefficient to the reference (SFT) policy; 0 disables the reference model.
        bf16: on a GPU, train in bf16 (ignored on CPU).
        use_vllm / vllm_gpu_memory_utilization: generate rollout turns with TRL's vLLM engine in colocate mode
            (``evoharness.training.rollouts.vllm_generate_fn``; GPUs only, ``pip install vllm``); otherwise
            ``model.generate`` on the training device. Candidate scoring (score decoding) runs on the training model
            either way.
        batch_episodes: ``turn`` context without vLLM: rollout episodes each process plays at once, their
            generation and scoring batched across them (``evoharness.policy.batched_play``), each game in an environment
            process of its own. Sampled tokens and their log-probabilities are recorded as at 1; the draws come
            from one shared generator, so an episode's draws depend on the batch (at 1, on its seed alone).
        num_processes / accelerate_config: the parallel rollout workers. GRPO runs under ``accelerate launch`` with
            this many processes (DDP: ``accelerate/cpu_<n>proc.yaml`` on CPUs by default, ``accelerate/ddp_gpu.yaml``
            with one process per GPU); each process plays ``prompts_per_step / num_processes`` of a step's games
            (whole groups: ``TurnRollouts`` plays one game per group) and trains on their samples. The
            step's metrics are gathered over all processes. Every process holds the whole model (DDP), so each
            generates on its own: with a large model use LoRA (``lora_r``), as the ``paper`` profile does.
        model_dtype / gradient_checkpointing / lora_*: as ``SFTStageConfig``; with ``lora_r`` > 0 GRPO trains a
            LoRA adapter (``GRPOTrainer(peft_config=...)``) and the adapter is merged into the saved final model.
            Gradient checkpointing is off by default, unlike TRL's ``GRPOConfig``: the embedded model is small and
            recomputing its activations only costs time. The ``paper`` profile turns it on.
    """

    split: str = "train"
    num_games: int = 8
    game_offset: int = 1000
    num_generations: int = 4
    turns_per_episode: int = 4
    turns_per_group: int = 0
    advantage: str = "grpo"
    gigpo_gamma: float = 0.95
    gigpo_omega: float = 1.0
    prompts_per_step: int = 2
    max_steps: int = 4
    micro_batch_size: int = 0
    max_env_steps: int = 20
    max_meta_actions: int = 12
    max_new_tokens: int = 48
    temperature: float = 0.7
    ground_track: bool = False
    batch_episodes: int = 1
    learning_rate: float = 1e-4
    beta: float = 0.0
    bf16: bool = False
    save_steps: int = 50
    seed: int = 0
    use_vllm: bool = False
    vllm_gpu_memory_utilization: float = 0.3

    def __post_init__(self):
        if self.num_processes < 1 or self.prompts_per_step % self.num_processes:
            raise ValueError(f"grpo.prompts_per_step ({self.prompts_per_step}) must be a multiple of "
                             f"grpo.num_processes ({self.num_processes}): each process plays whole groups")
        if self.temperature <= 0:
            raise ValueError(f"grpo.temperature is {self.temperature}: GRPO samples its rollouts, use a value > 0")
        if self.turns_per_episode < 1:
            raise ValueError(f"grpo.turns_per_episode is {self.turns_per_episode}: use 1 or more")
        if self.advantage not in ("grpo", "gigpo"):
            raise ValueError(f"grpo.advantage is {self.advantage!r}: use grpo or gigpo")
        if self.turns_per_group < 0 or 0 < self.turns_per_group < 2:
            raise ValueError(f"grpo.turns_per_group is {self.turns_per_group}: use 0 (off) or 2 or more")
        if self.advantage == "gigpo" and not self.turns_per_group:
            raise ValueError("grpo.advantage: gigpo needs grpo.turns_per_group > 0 (every turn a sample, each with "
                             "its own advantage)")
        if self.micro_batch_size < 0:
            raise ValueError(f"grpo.micro_batch_size is {self.micro_batch_size}: use 0 (a whole step) or more")
        if not 0 < self.gigpo_gamma <= 1:
            raise ValueError(f"grpo.gigpo_gamma is {self.gigpo_gamma}: use a value in (0, 1]")


@dataclass
class EvalConfig:
    """Evaluation of a policy on a split. ``limit`` 0 means every game of the split.

    ``decoding`` (language-model policies): how an ``act`` call becomes an admissible command. ``remap``: the
    generated command, or the admissible one closest to it (difflib); ``score``: the admissible command the model
    gives the highest log-likelihood as the call's argument (one batched forward pass over the candidates).

    ``act_each_turn``: ``score`` decoding of a model trained on ``parallel_calls`` turns: a turn that generated
    meta-actions but no act gets its act scored after them (``evoharness.policy.lm_policy.LMPolicy``), so every turn but
    the closing ``note`` is an environment step, as in every teacher turn whose command was a target. No effect on other
    layouts. False: such a turn runs its meta-actions only (evaluations recorded before 2026-12-01).

    ``ground_track``: ``score`` decoding: a ``track`` call's entity, and a location fact's value, are scored over the
    names in the latest observation (``evoharness.policy.lm_policy.LMPolicy``), so the Belief only holds names the
    policy has just read. False: the call is generated as it comes (every evaluation recorded before the setting, added
    2026-12-01; on in the ``full-parallel`` profiles since then).

    ``workers``: processes playing the games, each with its own copy of the policy and of the Experience store
    (``evoharness.evaluation.workers``). Worker k plays every ``workers``-th game from the k-th. A lesson one worker
    ``note``s is not recalled by the other, and ``random`` draws from one generator per process, so results can
    depend on ``workers`` (it is part of the settings an evaluation resumes with). 1: one process, the games in
    order.

    ``batch_episodes``: language-model policies: episodes each process plays at once, their generation and
    candidate scoring batched into one forward pass per turn across them (``evoharness.policy.batched_play``), each
    environment in a child process replaced every ``env_recycle_every`` episodes. Greedy outcomes equal one
    episode at a time up to float reduction order and what each episode recalls from lessons the others noted.
    1: one episode at a time, in this process.

    ``task_runner``: where the ``workers`` shards run. ``processes``: a local pool of spawned processes that end
    with the evaluation. ``dask``: Prefect tasks on Prefect's ``DaskTaskRunner`` (``prefect-dask``), a local cluster
    of ``workers`` single-threaded worker processes, or the running cluster at ``dask_address``
    (``tcp://host:8786``), whose workers must see this checkout, the games and the work folder at the same paths.
    The shards and what they play are the same either way; neither is part of an evaluation's identity.
    """

    split: str = "valid_seen"
    limit: int = 12
    max_env_steps: int = 40
    max_meta_actions: int = 20
    max_new_tokens: int = 48
    episode_timeout_s: float = 300.0
    decoding: str = "remap"
    seed: int = 0
    workers: int = 1
    act_each_turn: bool = True
    ground_track: bool = False
    batch_episodes: int = 1
    env_recycle_every: int = 50
    task_runner: str = "processes"
    dask_address: str = ""

    # fields added after evaluations were recorded, with the value those evaluations had: a setting at this value is
    # left out of an evaluation's identity, so older folders still resume and older MLflow runs are still reused
    IMPLICIT = {"workers": 1, "act_each_turn": False, "ground_track": False, "batch_episodes": 1}
    # how the games are run, never what they give: not in the identity
    OPERATIONAL = ("env_recycle_every", "task_runner", "dask_address")

    def identity(self) -> dict:
        """The settings that make two evaluations comparable (``dataclasses.asdict`` less ``IMPLICIT`` values)."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if not (k in self.IMPLICIT and v == self.IMPLICIT[k]) and k not in self.OPERATIONAL}

    def __post_init__(self):
        if self.workers < 1:
            raise ValueError(f"evaluate.workers is {self.workers}; use 1 or more processes")
        if self.batch_episodes < 1:
            raise ValueError(f"evaluate.batch_episodes is {self.batch_episodes}; use 1 or more episodes at once")
        if self.decoding not in ("remap", "score"):
            raise ValueError(f"evaluate.decoding is {self.decoding!r}; use 'remap' or 'score'")
        if self.task_runner not in ("processes", "dask"):
            raise ValueError(f"evaluate.task_runner is {self.task_runner!r}; use 'processes' or 'dask'")


@dataclass
class PromoteConfig:
    """When ``champion`` moves: to a candidate whose success rate on the evaluated games is at least the
    champion's on the same games and at least ``min_success`` (a policy that cannot play never becomes champion)."""

    min_success: float = 0.5

    def __post_init__(self):
        if not 0.0 <= self.min_success <= 1.0:
            raise ValueError(f"promote.min_success is {self.min_success}; use a success rate in [0, 1]")


@dataclass
class PipelineConfig:
    """All stages' configs plus the registered model's name."""

    profile: str = "default"
    collect: CollectConfig = field(default_factory=CollectConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    traces: TraceConfig = field(default_factory=TraceConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTStageConfig = field(default_factory=SFTStageConfig)
    grpo: GRPOStageConfig = field(default_factory=GRPOStageConfig)
    evaluate: EvalConfig = field(default_factory=EvalConfig)
    promote: PromoteConfig = field(default_factory=PromoteConfig)
    registered_model_name: str = "evoharness-policy"

    def to_dict(self) -> dict:
        """The resolved config as plain JSON-able data."""
        return dataclasses.asdict(self)

    def digest(self, section: str | None = None) -> str:
        """sha256 (hex, 16 chars) of one section's resolved values (or of the whole config), for lineage."""
        blob = json.dumps(dataclasses.asdict(getattr(self, section) if section else self), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


_SECTIONS = {
    "collect": CollectConfig,
    "ingest": IngestConfig,
    "cost": CostConfig,
    "traces": TraceConfig,
    "model": ModelConfig,
    "sft": SFTStageConfig,
    "grpo": GRPOStageConfig,
    "evaluate": EvalConfig,
    "promote": PromoteConfig,
}


def _read_profile(path: Path, seen: tuple = ()) -> dict:
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a profile is a mapping of sections, not {type(raw).__name__}")
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    parent_path = profile_path(parent)
    if not parent_path.exists() or parent in seen:
        raise ValueError(f"{path}: extends {parent!r}, which is missing or a cycle ({parent_path})")
    merged = _read_profile(parent_path, seen + (path.stem,))
    for key, values in raw.items():
        merged[key] = {**(merged.get(key) or {}), **values} if isinstance(values, dict) else values
    return merged


def _merge(base: dict, over: dict) -> dict:
    """``over`` on top of ``base``, dict-valued fields (``cost.per_call``) merged key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict:
    """Command-line overrides ``SECTION.FIELD=VALUE`` (``sft.learning_rate=1e-3``, ``cost.per_call.track=0.05``,
    ``registered_model_name=NAME``) -> ``{"section": {"field": value}}`` for ``load_profile``. Values are parsed by
    OmegaConf's dotlist grammar (``OmegaConf.from_dotlist``: numbers, ``true``/``false``, ``null``, strings), then
    checked against the field's type by ``load_profile``; OmegaConf is used for the parsing only, the dataclasses
    stay the schema. Raises ValueError naming an item without ``=`` or without a section."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for item in items:
        key = item.split("=", 1)[0]
        if "=" not in item or ("." not in key and key != "registered_model_name"):
            raise ValueError(f"override {item!r}: write SECTION.FIELD=VALUE, e.g. sft.learning_rate=1e-3 "
                             f"(sections: {sorted(_SECTIONS)})")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(list(items)))
    except OmegaConfBaseException as exc:
        raise ValueError(f"overrides {list(items)}: {exc}") from exc


def load_profile(name_or_path: str = "default", overrides: dict | None = None) -> PipelineConfig:
    """Resolve a profile into a ``PipelineConfig``.

    Args:
        name_or_path: a profile name (``profiles/<name>.yaml`` or ``profiles/experiments/<name>.yaml``) or a path to a
        YAML file. A profile may start
            from another with ``extends: <name>``; its sections' fields override the parent's field by field.
        overrides: ``{"section": {"field": value}}`` applied after the profile (``parse_overrides`` makes it from
            ``sft.learning_rate=1e-3`` strings); a dict-valued field is merged key by key.

    Raises:
        FileNotFoundError: no such profile; the message lists the available ones.
        ValueError: an unknown section or field (named in the message).
    """
    path = Path(name_or_path)
    if not path.suffix:
        path = profile_path(name_or_path)
    if not path.exists():
        known = known_profiles()
        raise FileNotFoundError(f"profile {name_or_path!r} not found ({path}); available: {known}")
    raw = _read_profile(path)
    for section, values in (overrides or {}).items():
        raw[section] = _merge(raw.get(section) or {}, values) if isinstance(values, dict) else values
    cfg = PipelineConfig(profile=path.stem)
    for key, values in raw.items():
        if key == "registered_model_name":
            cfg.registered_model_name = str(values)
            continue
        if key not in _SECTIONS:
            raise ValueError(f"{path}: unknown section {key!r}; expected one of {sorted(_SECTIONS)}")
        values = values or {}
        if not isinstance(values, dict):
            raise ValueError(f"{path}: section {key!r} must be a mapping of fields, not {values!r}")
        fields = {f.name: f for f in dataclasses.fields(_SECTIONS[key])}
        unknown = set(values) - set(fields)
        if unknown:
            raise ValueError(f"{path}: section {key!r} has unknown fields {sorted(unknown)}")
        default = getattr(cfg, key)
        for name, value in values.items():
            _check_type(path, key, name, getattr(default, name), value)
        # a dict-valued field (cost.per_call) given in part keeps its other keys
        values = {k: _merge(getattr(default, k), v) if isinstance(v, dict) else v for k, v in values.items()}
        setattr(cfg, key, dataclasses.replace(default, **values))
    return cfg


def _check_type(path: Path, section: str, name: str, default, value) -> None:
    """Reject a profile value whose type differs from the field's default (ints are accepted for floats)."""
    expected = type(default)
    ok = isinstance(value, expected) and not (isinstance(value, bool) and expected is not bool)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ValueError(f"{path}: {section}.{name} is {value!r} ({type(value).__name__}); expected "
                         f"{expected.__name__} like the default {default!r}")
