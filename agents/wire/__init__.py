"""Wire formats shared by agents and tests."""
