"""``lora.targets`` as module path patterns: ``*`` stands for one name of a module's path (a block's index), so
``vace_blocks.*.attn1.to_q`` adapts the VACE blocks' self-attention and not the main blocks' (DiffSynth-Studio's
``--lora_base_model vace``); suffixes keep peft's rule; a pattern that selects nothing is refused in one line whose
advice works; the planner counts the adapters the patterns add."""

from __future__ import annotations

import pytest
from torch import nn

from ringdit.common.errors import ConfigError
from ringdit.costs.model_size import lora_parameters
from ringdit.models.lora import add_lora, matches_targets
from tests.helpers import architecture

VACE_TARGETS = ["vace_blocks.*.*.to_q", "vace_blocks.*.*.to_k", "vace_blocks.*.*.to_v", "vace_blocks.*.*.to_out.0",
                "vace_blocks.*.ffn.net.0.proj", "vace_blocks.*.ffn.net.2"]  # the recipe's: q,k,v,o,ffn.0,ffn.2


def tiny_vace():
    from ringdit.models.diffusers import DiffusersTransformer

    return DiffusersTransformer("wan_vace", config=architecture("wan_vace_tiny"), input_size=(3, 8, 8), in_channels=4,
                                text_len=7, text_dim=16)


def test_a_star_stands_for_one_name_of_the_path():
    assert matches_targets("vace_blocks.0.attn1.to_q", ["vace_blocks.*.attn1.to_q"])
    assert matches_targets("transformer.vace_blocks.11.attn1.to_q", ["vace_blocks.*.attn1.to_q"])  # a suffix
    assert not matches_targets("blocks.0.attn1.to_q", ["vace_blocks.*.attn1.to_q"])
    assert not matches_targets("vace_blocks.0.attn1.to_qk", ["vace_blocks.*.attn1.to_q"])
    assert not matches_targets("vace_blocks.0.1.attn1.to_q", ["vace_blocks.*.attn1.to_q"])  # one name, not two
    assert matches_targets("blocks.0.attn1.to_q", ["to_q"]) and matches_targets("blocks.0.attn1.to_q", "attn1.to_q")
    assert not matches_targets("blocks.0.attn1.xto_q", ["to_q"])  # suffixes are whole names, as peft's


def test_patterns_adapt_the_vace_blocks_alone_and_the_planner_counts_them():
    model = tiny_vace()
    linears = {name: module for name, module in model.transformer.named_modules() if isinstance(module, nn.Linear)}
    selected = {name for name in linears if matches_targets(name, VACE_TARGETS)}
    assert selected and all(name.startswith("vace_blocks.") for name in selected)
    assert any(name.startswith("blocks.") for name in linears)  # the main blocks, left alone
    counted, _ = lora_parameters(model, {"rank": 4, "targets": VACE_TARGETS})
    add_lora(model, rank=4, targets=VACE_TARGETS)
    adapted = {name.rsplit(".lora_A.", 1)[0] for name, _ in model.transformer.named_parameters() if ".lora_A." in name}
    assert adapted == selected
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trained == counted == sum(4 * (linears[n].in_features + linears[n].out_features) for n in selected)


def test_a_pattern_that_selects_nothing_is_refused_and_its_advice_works():
    model = tiny_vace()
    with pytest.raises(ConfigError, match=r"^lora.targets: vace_block.\*.attn1.to_q selects no linear layer of "
                                          r"DiffusersTransformer \(\* stands for one name of a module's path\); its "
                                          r"layers' paths are such as \[.*'vace_blocks.\*.attn1.to_q'") as refusal:
        add_lora(model, rank=4, targets=["to_k", "vace_block.*.attn1.to_q"])  # to_k matches: peft alone would pass
    assert "\n" not in str(refusal.value)
    add_lora(tiny_vace(), rank=4, targets=["to_k", "vace_blocks.*.attn1.to_q"])  # the path the refusal lists
