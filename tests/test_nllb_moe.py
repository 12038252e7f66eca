"""NLLB-MoE stays refused, and stock transformers' own experts module does not compute its routing: this test pins
what docs/families.md ("Known gaps") says of it, and fails once transformers fixes ``NllbMoeExperts``."""

import pytest
import torch
from transformers import NllbMoeConfig
from transformers.models.nllb_moe.modeling_nllb_moe import NllbMoeSparseMLP

from moecompress.errors import UserInputError
from moecompress.families import adapter_for

E, H = 4, 16


def test_the_family_stays_refused_with_one_line():
    with pytest.raises(
        UserInputError, match="nllb-moe is not supported: stock transformers' NllbMoeExperts runs expert_0"
    ):
        adapter_for({"model_type": "nllb-moe", "num_experts": E, "d_model": H})


def test_stock_nllb_moe_experts_run_expert_0_and_1_whatever_the_router_chose():
    torch.manual_seed(0)
    config = NllbMoeConfig(d_model=H, num_experts=E, moe_token_dropout=0.0, moe_eval_capacity_token_fraction=1.0)
    block = NllbMoeSparseMLP(config, ffn_dim=24).eval()
    with torch.no_grad():
        block.router.classifier.weight.normal_(0, 2)
    tokens = torch.randn(1, 10, H, generator=torch.Generator().manual_seed(1))
    called: list[int] = []
    for expert in range(E):
        block.experts[f"expert_{expert}"].register_forward_hook(lambda *_, e=expert: called.append(e))
    with torch.no_grad():
        stock = block(tokens)[0]
        ran = sorted(set(called))
        top_1, gates, _ = block.router(tokens.view(-1, H))
        routed = sum(block.experts[f"expert_{e}"](tokens[0]) * gates[:, e : e + 1] for e in range(E))
    chosen = set(top_1.argmax(dim=-1).tolist()) | set(gates.nonzero()[:, 1].tolist())
    assert chosen - {0, 1}, "the router must choose experts past 0 and 1 for the test to say anything"
    assert ran == [0, 1]
    assert (stock - routed).abs().max() > 0.1
