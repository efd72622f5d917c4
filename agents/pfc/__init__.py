"""PFC agent: per-namespace 802.1Qbb pause generation and reaction (see logic.py)."""
