"""User-space RoCE transport: pure logic first (`agents.roce.cc`: DCQCN, DCTCP, no-CC)."""
