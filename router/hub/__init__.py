"""Models from a Hugging Face-style hub: a leaf the rest of the router reaches through one
function, `PULLS.fetch(ref, on_progress)` (router.hub.pulls), so tests point it at a stand-in hub
(`HF_ENDPOINT`, worker/testing/stand_in_hub.py).

    choice.py     which files make a model (llama.cpp's -hf rules), pure
    download.py   list (huggingface_hub's HfApi), download, resume, verify, link into the cache
    pulls.py      one pull per reference in flight in the router, progress to every asker
    routes.py     pulling while serving: `POST /models/pull` and Ollama's `POST /api/pull`
    pull_cli.py   `omni-router pull REPO[:TAG]`: a progress bar, where the model is, its preset lines
"""
