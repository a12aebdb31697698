"""Keys for a team: who may call which route, which models a key sees, its limits, its usage.

    keyfile   the `--keys` TOML file (hashes only) -> a Keyring; `omni-router keys add`
    access    the route table: public / user / admin, pure
    guard     the one middleware: 401, 403, rate and concurrency limits, the audit line
    context   the request's key, for the two readers below
    views     what a key sees of the models (its own; internals for admin keys only)
    limits    token buckets (rpm, tpm) and the concurrency gate, pure but for the gate's futures
    usage     requests and tokens by key and model (/metrics, /keys/usage)
    book      the keys' state, one owner (reloaded with the presets)
    routes    GET /keys/usage
    cli       `omni-router keys add NAME ...`

A model outside a key's list is not there for it: `Pool.get` (every API resolves names there)
asks router.keys.context, so OpenAI, Anthropic, Responses and Ollama routes all answer 404.
"""
