"""The FedForge web dashboard (FastAPI): rounds, factories, privacy spend and model versions, live."""
