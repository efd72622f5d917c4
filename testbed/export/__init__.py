"""Exporters of a compiled plan into other tools' formats.

Each module turns a `Plan` into text another tool reads (a Mininet topology module,
...). Pure: no kernel, no files; the CLI writes the text where the user asks. It sits
above `plan` (it reads plans) and below `cli`.
"""
