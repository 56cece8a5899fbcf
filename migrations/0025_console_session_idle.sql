-- Session hygiene (issue 40): a web session unused for `CONSOLE_SESSION_IDLE_SECONDS` (30 minutes
-- by default) ends, besides its lifetime. Every page a session opens moves its idle clock.
-- A constant default: adding the column rewrites nothing; sessions open at the upgrade count as
-- used then.

ALTER TABLE {{schema}}.console_sessions ADD COLUMN last_seen_at timestamptz NOT NULL DEFAULT now();
COMMENT ON COLUMN {{schema}}.console_sessions.last_seen_at IS 'When the session last opened a page; unused for the idle timeout (CONSOLE_SESSION_IDLE_SECONDS), it leads back to the login page.';
