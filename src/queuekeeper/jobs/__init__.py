"""The job framework: runs and their records, the scheduler, background runs. It knows no job:
the composition root (`app.py`) hands it the table of jobs."""
