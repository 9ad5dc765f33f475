"""Prompts rendered with the model's own chat template, through the controller: a run whose
tokenizer carries a Llama-3-shaped template (not ChatML) sends the workers each problem's chat
prompt exactly as HF transformers renders that template."""

from __future__ import annotations

import numpy as np
from transformers import PreTrainedTokenizerFast

from rlax_tpu.config import RunConfig, from_dict, to_dict
from rlax_tpu.controller import tasks as tasks_lib
from rlax_tpu.models import Tokenizer
from tests.controller.test_partial_rollouts import Recorded
from tests.controller.test_scheduling import make_config, run_controller
from tests.models.conftest import smollm2_gguf_path
from tests.models.test_tokenizer import LLAMA3_STYLE


class _Transformers:
    """transformers' own rendering, in the shape prompt_text calls."""

    def __init__(self, directory):
        self.hf = PreTrainedTokenizerFast(
            tokenizer_file=str(directory / "tokenizer.json"),
            bos_token="<|im_start|>",
            eos_token="<|im_end|>",
        )

    def apply_chat_template(self, messages, *, add_generation_prompt=True):
        return self.hf.apply_chat_template(
            messages,
            chat_template=LLAMA3_STYLE,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )


def test_the_models_own_chat_template_renders_the_prompts(tmp_path):
    smollm2 = Tokenizer.from_gguf(str(smollm2_gguf_path()))
    tokenizer_dir = tmp_path / "tokenizer"
    Tokenizer(
        smollm2.backend, bos="<|im_start|>", eos="<|im_end|>", chat_template=LLAMA3_STYLE
    ).save(tokenizer_dir)
    d = to_dict(make_config(tmp_path / "run", num_steps=1, prompts_per_step=2))
    # A tiny random model over SmolLM2's vocabulary, with that tokenizer and template.
    d["model"] |= dict(
        vocab_size=49152, tokenizer_path=str(tokenizer_dir), max_position_embeddings=1024
    )
    d["inference"] |= dict(max_prompt_len=512)
    d["data"] |= dict(prompt_style="chat")
    rollouts = []

    def wrap(comps):
        comps.workers = [Recorded(w, rollouts) for w in comps.workers]

    ctl = run_controller(from_dict(RunConfig, d), wrap)
    ours, reference = ctl.prompter.tokenizer, _Transformers(tokenizer_dir)
    assert ours.chat_template == LLAMA3_STYLE and ctl.prompter.style == "chat"
    checked = set()
    for ro in rollouts:
        dataset, _, problem_id = ro.prompt_id.split("#")[0].partition("/")
        problem = ctl.prompter.datasets.problem(dataset, problem_id) if dataset != "eval" else None
        if problem is None or ro.prompt_id in checked:
            continue
        checked.add(ro.prompt_id)
        want = tasks_lib.prompt_text(problem, style="chat", language="python", tokenizer=reference)
        assert want.startswith("<|im_start|><|start_header_id|>system<|end_header_id|>")
        np.testing.assert_array_equal(ro.prompt_tokens, ours.encode(want))
    assert len(checked) >= 2
