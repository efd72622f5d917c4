"""The run directory's formats, shared by the writer (`testbed.run`) and the reader
(`testbed.report`): counters.sqlite (`store`), summary.json's tables (`tables`) and the
file conventions and format version (`files`). Below both in the layering, so the
report reads a run directory without importing the run."""
