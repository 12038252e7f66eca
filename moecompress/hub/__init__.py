"""Publishing moecompress outputs to the Hugging Face Hub: the model card and the one-commit upload."""

from .card import CardInfo, build_card
from .push import PushPlan, plan_push, push_plan

__all__ = ["CardInfo", "PushPlan", "build_card", "plan_push", "push_plan"]
