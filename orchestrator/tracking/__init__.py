"""MLflow: the client and its outages (`client`), a job's run (`runs`), every tag name (`tags`), how a run ends
(`status`), the job's summary table and plots (`job_summary`, `plots`), the checkout's commit (`gitinfo`)."""
