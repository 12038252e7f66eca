"""The layer engine: the calibration sweep that streams hidden states through a model not in memory (engine),
the experts module it computes with (view_experts), its resumable state (state), what a layer hands to later
ones (layer_carry) and the multi-token-prediction layers' inputs (mtp)."""
