"""Importers of other tools' experiment files into fabric configs.

Each module reads one tool's files and returns a fabric config (a plain dict the
normal loader validates) plus the notes a reader needs: what was mapped, what was
not and what was done instead. No module here touches the kernel.
"""
