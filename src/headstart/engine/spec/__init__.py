"""Speculative decoding: the DFlash drafter, proposals, verification rules, the planner, and each
drafting stream's queue of target features."""
