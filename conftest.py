"""Root conftest: plugins that must see every test item, wherever it lives (tests/, notebooks/, solutions/)."""
pytest_plugins = ["tests.notebooks.notebook_times"]
