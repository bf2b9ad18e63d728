"""The services over the store, built by services.wiring from typed edges."""
