-- A private job's join token: workers must present it to take part. Empty for a public job.
ALTER TABLE jobs ADD COLUMN join_token TEXT NOT NULL DEFAULT '';
