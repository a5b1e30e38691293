"""Operations, at the bottom: settings, logs, metrics, tracing, payload logging, the process's
runtime and the frameworks' patches. Imports nothing else of the app."""
