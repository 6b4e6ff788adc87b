"""The bundle: the contract between the compiler and the runtime (manifest schema, writer, reader)."""
