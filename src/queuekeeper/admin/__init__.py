"""The admin API: its routers' conventions and the run records."""
