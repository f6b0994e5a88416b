"""The process core under every front end: settings, environment, errors, logging, the shared
enums and dtypes, the engine's build, the process's communicators (context), the rendezvous
through the store, the GPU-path choice and the wiring of groups. Nothing here imports the
collectives, wrap, the launcher or the front ends."""
