"""Chat answers spoken: a chat model paired with a voice by its preset (`speech-model = NAME`).

    wire    the chat request's `modalities` and `audio` fields (pydantic at the edge)
    chat    `SpokenChat`: runs the chat, cuts its text into sentences and has the voice speak them
"""
