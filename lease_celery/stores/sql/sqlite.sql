-- SQLite dialect. Parameters are named (:key). :now is the store clock, sampled after
-- BEGIN IMMEDIATE took the write lock, so no other writer can act between the reading of the
-- clock and the write.

-- name: create_leases
-- The leases table as of schema 3 (2 + checkpoint, cancel; schemas 4 and 5 add the history
-- table and its triggers; lease_celery/stores/sql_glue.py lists them all). settling: the key is
-- done (or dead) and its owner has not yet confirmed that Celery stored the outcome; expires_at
-- is then the settle deadline. sweep_at: when the sweeper should next look at the row (NULL:
-- never; terminal rows, rows without task info), so a sweep reads only what it may act on,
-- through a partial index.
CREATE TABLE IF NOT EXISTS lease_celery_leases (
    key         TEXT    PRIMARY KEY,
    state       TEXT    NOT NULL CHECK (state IN ('ready', 'running', 'done', 'dead')),
    owner       TEXT,
    token       INTEGER NOT NULL CHECK (token >= 0),
    expires_at  REAL,
    attempts    INTEGER NOT NULL DEFAULT 0,  -- claims so far (reset by requeue)
    takeovers   INTEGER NOT NULL DEFAULT 0,  -- claims that found the previous owner's lease expired
    not_before  REAL,                        -- backoff: not claimable before this instant
    reason      TEXT,                        -- last error, why dead, or an operator's note
    task        TEXT,                        -- JSON: what is needed to re-publish the task
    result      TEXT,
    updated_at  REAL    NOT NULL,
    fence       INTEGER NOT NULL DEFAULT 0,
    settling    INTEGER NOT NULL DEFAULT 0,
    sweep_at    REAL,
    swept_by    TEXT,                        -- the sweep call that last re-published the row
    checkpoint  TEXT,                        -- JSON: the holder's latest progress checkpoint
    cancel      TEXT,                        -- 'cancelled: ...' once an operator cancelled it
    grp         TEXT,                        -- schema 6: the limit group a limited claim took
    slot        INTEGER                      -- ... and the slot token it was granted
) WITHOUT ROWID

-- name: create_sweep_index
CREATE INDEX IF NOT EXISTS lease_celery_leases_sweep ON lease_celery_leases (sweep_at)
WHERE sweep_at IS NOT NULL

-- name: create_terminal_index
-- Retention reads the oldest terminal rows, and only those. The state beside the time (schema
-- 7) lets stats() count the settled rows in the index alone: without it, each entry cost a
-- read of its row (5.6 s at a million rows, against 0.45-0.7 s for the whole table).
CREATE INDEX IF NOT EXISTS lease_celery_leases_terminal ON lease_celery_leases
(updated_at, state) WHERE state IN ('done', 'dead')

-- name: drop_terminal_index
-- Schema 7: the index above as schemas 2 to 6 made it, without the state.
DROP INDEX IF EXISTS lease_celery_leases_terminal

-- name: create_live_index
-- Schema 7: the operator's reads of live rows (find by state, stats, the dashboard's lists)
-- walk this instead of the table. Only live rows: a claim adds an entry and a finish takes it
-- away, so it stays the size of the work in hand, however many rows are settled.
CREATE INDEX IF NOT EXISTS lease_celery_leases_live ON lease_celery_leases (state, updated_at)
WHERE state IN ('ready', 'running')

-- name: create_dead_index
-- Schema 7: dead rows, few among the settled ones (the dashboard's dead list, stats).
CREATE INDEX IF NOT EXISTS lease_celery_leases_dead ON lease_celery_leases (updated_at)
WHERE state = 'dead'

-- name: create_effects_state_index
-- Schema 8: the receipts of one state (the reconcile queue: effect_find, the Django admin's
-- state filter) are a range of this, newest first; without it a rare state was found by
-- reading every receipt.
CREATE INDEX IF NOT EXISTS lease_celery_effects_state ON lease_celery_effects
(state, updated_at)

-- name: table_columns
SELECT name FROM pragma_table_info('lease_celery_leases')

-- name: migrate_settling
ALTER TABLE lease_celery_leases ADD COLUMN settling INTEGER NOT NULL DEFAULT 0

-- name: migrate_sweep_at
ALTER TABLE lease_celery_leases ADD COLUMN sweep_at REAL

-- name: migrate_swept_by
ALTER TABLE lease_celery_leases ADD COLUMN swept_by TEXT

-- name: migrate_checkpoint
ALTER TABLE lease_celery_leases ADD COLUMN checkpoint TEXT

-- name: migrate_cancel
ALTER TABLE lease_celery_leases ADD COLUMN cancel TEXT

-- name: migrate_grp
ALTER TABLE lease_celery_leases ADD COLUMN grp TEXT

-- name: migrate_slot
ALTER TABLE lease_celery_leases ADD COLUMN slot INTEGER

-- name: create_slots_index
-- Schema 6: a group's running count reads only its running rows (lease_celery.limits).
CREATE INDEX IF NOT EXISTS lease_celery_leases_slots ON lease_celery_leases (grp, expires_at)
WHERE grp IS NOT NULL AND state = 'running'

-- name: create_limits
-- Schema 6: one row per limit group. task_*: the limit and rate its tasks ask for (the latest
-- claim's); set_*: an operator's (celery leases limit), which win (NULL: the task's; 0 and ''
-- lift it). tat: the next allowed start of a rate-limited group (GCRA's theoretical arrival
-- time); slots: the slot tokens granted so far; seq: the waiters' arrival counter.
CREATE TABLE IF NOT EXISTS lease_celery_limits (
    grp           TEXT    PRIMARY KEY,
    task_limit    INTEGER,
    task_rate     TEXT,
    task_interval REAL,
    set_limit     INTEGER,
    set_rate      TEXT,
    set_interval  REAL,
    tat           REAL,
    slots         INTEGER NOT NULL DEFAULT 0,
    seq           INTEGER NOT NULL DEFAULT 0,
    updated_at    REAL    NOT NULL
) WITHOUT ROWID

-- name: create_waiters
-- Schema 6: deliveries parked over their group's limit, one per key, in arrival order (seq),
-- with the task info that publishes them again; handed_at: when a freed slot handed it on.
CREATE TABLE IF NOT EXISTS lease_celery_waiters (
    grp        TEXT    NOT NULL,
    key        TEXT    NOT NULL,
    seq        INTEGER NOT NULL,
    task       TEXT,
    since      REAL    NOT NULL,
    handed_at  REAL,
    PRIMARY KEY (grp, key)
) WITHOUT ROWID

-- name: create_waiters_order_index
CREATE INDEX IF NOT EXISTS lease_celery_waiters_order ON lease_celery_waiters (grp, seq)

-- name: limit_upsert
-- A limited claim records the limit and rate its task asks for, and reads what is in force.
INSERT INTO lease_celery_limits (grp, task_limit, task_rate, task_interval, updated_at)
VALUES (:grp, :limit, :rate, :interval, :now)
ON CONFLICT (grp) DO UPDATE SET
    task_limit = excluded.task_limit, task_rate = excluded.task_rate,
    task_interval = excluded.task_interval
RETURNING task_limit, set_limit, task_interval, set_interval, tat, slots

-- name: key_held
-- The key itself refuses a claim: a live lease, a backoff, or done/dead (claim's condition,
-- negated; no row is claimable).
SELECT 1 FROM lease_celery_leases
WHERE key = :key
  AND NOT ((state = 'ready' AND (not_before IS NULL OR not_before <= :now))
           OR (state = 'running' AND expires_at <= :now))

-- name: group_running
SELECT count(*) FROM lease_celery_leases
WHERE grp = :grp AND state = 'running' AND expires_at > :now AND key <> :key

-- name: waiters_ahead
-- The waiters before this key's place (all of them when it has none).
SELECT count(*) FROM lease_celery_waiters
WHERE grp = :grp
  AND seq < COALESCE((SELECT seq FROM lease_celery_waiters WHERE grp = :grp AND key = :key),
                     9223372036854775807)

-- name: waiter_park
-- Over the limit: the key waits, once, in arrival order; a waiter handed on and refused again
-- keeps its place and waits to be handed on again.
INSERT INTO lease_celery_waiters (grp, key, seq, task, since)
VALUES (:grp, :key, (SELECT seq + 1 FROM lease_celery_limits WHERE grp = :grp), :task, :now)
ON CONFLICT (grp, key) DO UPDATE SET handed_at = NULL

-- name: group_seq_bump
UPDATE lease_celery_limits SET seq = seq + 1 WHERE grp = :grp

-- name: waiter_count
SELECT count(*) FROM lease_celery_waiters WHERE grp = :grp

-- name: waiter_drop
DELETE FROM lease_celery_waiters WHERE grp = :grp AND key = :key

-- name: group_granted
-- A slot was granted: its token is spent, and a rate-limited group's next start moves on.
UPDATE lease_celery_limits
SET slots = slots + 1, updated_at = :now,
    tat = CASE WHEN :interval IS NULL THEN tat ELSE max(COALESCE(tat, :now), :now) + :interval END
WHERE grp = :grp

-- name: groups_waiting
SELECT DISTINCT grp FROM lease_celery_waiters ORDER BY grp LIMIT :limit

-- name: group_limit
SELECT task_limit, set_limit FROM lease_celery_limits WHERE grp = :grp

-- name: waiters_first
SELECT grp, key, task, since, handed_at FROM lease_celery_waiters
WHERE grp = :grp ORDER BY seq LIMIT :limit

-- name: waiter_handed
UPDATE lease_celery_waiters SET handed_at = :now WHERE grp = :grp AND key = :key

-- name: limit_set
INSERT INTO lease_celery_limits (grp, set_limit, set_rate, set_interval, updated_at)
VALUES (:grp, :set_limit, :set_rate, :set_interval, :now)
ON CONFLICT (grp) DO UPDATE SET
    set_limit    = CASE WHEN :change_limit THEN excluded.set_limit ELSE set_limit END,
    set_rate     = CASE WHEN :change_rate THEN excluded.set_rate ELSE set_rate END,
    set_interval = CASE WHEN :change_rate THEN excluded.set_interval ELSE set_interval END,
    tat          = CASE WHEN :change_rate THEN NULL ELSE tat END,
    updated_at   = excluded.updated_at

-- name: limits_list
SELECT l.grp, l.task_limit, l.task_rate, l.set_limit, l.set_rate, l.updated_at,
       (SELECT count(*) FROM lease_celery_leases r
        WHERE r.grp = l.grp AND r.state = 'running' AND r.expires_at > :now) AS running,
       (SELECT count(*) FROM lease_celery_waiters w WHERE w.grp = l.grp) AS waiting
FROM lease_celery_limits l
WHERE :grp IS NULL OR l.grp = :grp
ORDER BY l.grp LIMIT :limit

-- name: migrate_fill_sweep_at
-- Schema 1 -> 2: rows the sweeper must keep watching get their next look; done rows of schema
-- 1 were settled by definition (no settle phase existed).
UPDATE lease_celery_leases
SET sweep_at = CASE WHEN state = 'running' THEN expires_at
                    ELSE COALESCE(not_before, updated_at) END
WHERE state IN ('running', 'ready') AND task IS NOT NULL

-- name: create_history
-- Schema 4: every event of every key (lease_celery.history), pruned by lease_retention.
CREATE TABLE IF NOT EXISTS lease_celery_history (
    key     TEXT NOT NULL,
    at      REAL NOT NULL,
    event   TEXT NOT NULL,
    owner   TEXT,
    token   INTEGER,
    fence   INTEGER,
    detail  TEXT
)

-- name: create_history_key_index
CREATE INDEX IF NOT EXISTS lease_celery_history_key ON lease_celery_history (key, at)

-- name: drop_history_at_index
-- Schema 5: the entries across keys are read, and pruned, in insertion order (rowid), which
-- the table keeps anyway: an index on the time cost every transition a third write.
DROP INDEX IF EXISTS lease_celery_history_at

-- name: create_history_on_claim
-- Schema 5: the store writes each key's transitions into its history itself, in the statement
-- that makes them (a trigger: same transaction, no round trip, nothing a crash can lose).
-- Events that are no transition of the row (a local lapse, a refused stale finish, an answer,
-- a sweeper's re-publish, an operator's action) are written by lease_celery.history.
CREATE TRIGGER IF NOT EXISTS lease_celery_history_new_key
AFTER INSERT ON lease_celery_leases WHEN NEW.state = 'running'
BEGIN
    INSERT INTO lease_celery_history (key, at, event, owner, token, fence, detail)
    VALUES (NEW.key, NEW.updated_at, 'claimed', NEW.owner, NEW.token, NEW.fence, NULL);
END

-- name: create_history_on_transition
-- A new token is a claim (a takeover if the row was running: its lease had lapsed); running ->
-- done a finish; -> dead with its reason; running -> ready a release, or a retry when a backoff
-- follows; a settling row changing owner a completion (task.py, _complete). Renewals, settle
-- confirmations and checkpoints change none of these and write nothing.
CREATE TRIGGER IF NOT EXISTS lease_celery_history_transition
AFTER UPDATE ON lease_celery_leases
WHEN NEW.token <> OLD.token OR NEW.state <> OLD.state
  OR (NEW.settling = 1 AND OLD.settling = 1 AND NEW.owner IS NOT OLD.owner)
BEGIN
    INSERT INTO lease_celery_history (key, at, event, owner, token, fence, detail)
    SELECT NEW.key, NEW.updated_at, event, NEW.owner, NEW.token, NEW.fence, detail FROM (
        SELECT CASE
                 WHEN NEW.token <> OLD.token AND OLD.state = 'running' THEN 'taken_over'
                 WHEN NEW.token <> OLD.token THEN 'claimed'
                 WHEN NEW.state = 'done' AND OLD.state = 'running' THEN 'finished'
                 WHEN NEW.state = 'dead' THEN 'dead'
                 WHEN NEW.state = 'ready' AND OLD.state = 'running'
                      AND NEW.not_before > NEW.updated_at THEN 'retry'
                 WHEN NEW.state = 'ready' AND OLD.state = 'running' THEN 'released'
                 WHEN NEW.settling = 1 AND OLD.settling = 1 THEN 'completed'
               END AS event,
               CASE
                 WHEN NEW.token <> OLD.token AND OLD.state = 'running'
                      THEN 'the lease of ' || COALESCE(OLD.owner, '?') || ' (token ' || OLD.token
                           || ') had lapsed'
                 WHEN NEW.token <> OLD.token THEN NULL
                 WHEN NEW.state = 'ready' AND NEW.not_before > NEW.updated_at
                      THEN COALESCE(NEW.reason, 'released') || '; claimable again in '
                           || printf('%.2f', NEW.not_before - NEW.updated_at) || 's'
                 WHEN NEW.state IN ('dead', 'ready') THEN NEW.reason
                 WHEN NEW.settling = 1 AND OLD.settling = 1 AND NEW.state = OLD.state
                      THEN 'its owner ' || COALESCE(OLD.owner, '?')
                           || ' left the ' || NEW.state || ' key unsettled: completed by this delivery'
               END AS detail)
    WHERE event IS NOT NULL;
END

-- name: history_insert
INSERT INTO lease_celery_history (key, at, event, owner, token, fence, detail)
VALUES (?, ?, ?, ?, ?, ?, ?)

-- name: history_of
SELECT key, at, event, owner, token, fence, detail FROM (
    SELECT rowid AS n, * FROM lease_celery_history WHERE key = :key
    ORDER BY at DESC, rowid DESC LIMIT :limit)
ORDER BY at, n

-- name: history_many
-- history_of for every key of the JSON array :keys at once (the dashboard's /running page).
SELECT key, at, event, owner, token, fence, detail FROM (
    SELECT rowid AS n, *, row_number() OVER (PARTITION BY key ORDER BY at DESC, rowid DESC) AS r
    FROM lease_celery_history WHERE key IN (SELECT value FROM json_each(:keys)))
WHERE r <= :limit
ORDER BY key, at, n

-- name: history_recent
SELECT key, at, event, owner, token, fence, detail FROM (
    SELECT rowid AS n, * FROM lease_celery_history
    WHERE :events IS NULL OR event IN (SELECT value FROM json_each(:events))
    ORDER BY rowid DESC LIMIT :limit)
ORDER BY at DESC, n DESC

-- name: history_prune
-- The oldest entries first, by insertion order: a batch reads :limit rows from the start of
-- the table and deletes those older than the cutoff.
DELETE FROM lease_celery_history
WHERE rowid IN (SELECT rowid FROM lease_celery_history ORDER BY rowid LIMIT :limit)
  AND at < :cutoff

-- name: create_fence
-- The store-wide fence: one counter, bumped in the same transaction as every claim.
CREATE TABLE IF NOT EXISTS lease_celery_fence (
    id     INTEGER PRIMARY KEY CHECK (id = 1),
    value  INTEGER NOT NULL
)

-- name: init_fence
INSERT INTO lease_celery_fence (id, value) VALUES (1, 0) ON CONFLICT (id) DO NOTHING

-- name: bump_fence
UPDATE lease_celery_fence SET value = value + 1 WHERE id = 1

-- name: create_retired
-- The last token of every purged key: a re-created key continues from it, never from 1.
CREATE TABLE IF NOT EXISTS lease_celery_retired (
    key    TEXT    PRIMARY KEY,
    token  INTEGER NOT NULL
) WITHOUT ROWID

-- name: create_effects
-- Effect receipts (lease_celery.effects): one row per business key. Every change bumps
-- version, and every change is conditional on the version the caller read.
CREATE TABLE IF NOT EXISTS lease_celery_effects (
    key          TEXT    PRIMARY KEY,
    fingerprint  TEXT    NOT NULL,
    state        TEXT    NOT NULL CHECK (state IN ('in_flight', 'done', 'needs_reconciliation')),
    lease_key    TEXT,
    lease_token  INTEGER,
    lease_owner  TEXT,
    started_at   REAL    NOT NULL,
    attempts     INTEGER NOT NULL,
    result       TEXT,
    version      INTEGER NOT NULL,
    updated_at   REAL    NOT NULL
) WITHOUT ROWID

-- name: create_meta
CREATE TABLE IF NOT EXISTS lease_celery_meta (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID

-- name: get_schema_version
SELECT value FROM lease_celery_meta WHERE name = 'schema_version'

-- name: set_schema_version
INSERT INTO lease_celery_meta (name, value) VALUES ('schema_version', :version)
ON CONFLICT (name) DO UPDATE SET value = excluded.value

-- name: claim
-- A new key starts at token 1 (or after its retired token). An existing row may be taken only
-- when it is ready and past its backoff, or running with an expired lease (expires_at <= now:
-- the boundary instant counts as expired) -- a takeover. In the SET list, bare column names are
-- the row's values before this update. The sweeper looks at the row again when this lease
-- expires (if it can re-publish it: task info recorded).
INSERT INTO lease_celery_leases
       (key, state, owner, token, expires_at, attempts, takeovers, result, updated_at, fence,
        task, sweep_at, grp, slot)
VALUES (:key, 'running', :owner,
        COALESCE((SELECT token FROM lease_celery_retired WHERE key = :key), 0) + 1,
        :expires_at, 1, 0, NULL, :now, (SELECT value + 1 FROM lease_celery_fence WHERE id = 1),
        :task, CASE WHEN :task IS NULL THEN NULL ELSE :expires_at END, :grp, :slot)
ON CONFLICT (key) DO UPDATE SET
    state      = 'running',
    owner      = excluded.owner,
    token      = token + 1,
    expires_at = excluded.expires_at,
    attempts   = attempts + 1,
    takeovers  = takeovers + (state = 'running'),
    not_before = NULL,
    result     = NULL,
    updated_at = excluded.updated_at,
    fence      = excluded.fence,
    task       = excluded.task,  -- this delivery's, or none: never a previous one's
    settling   = 0,
    sweep_at   = excluded.sweep_at,
    swept_by   = NULL,
    grp        = excluded.grp,  -- a limited claim's group and slot (schema 6), or none
    slot       = excluded.slot
WHERE (state = 'ready' AND (not_before IS NULL OR not_before <= :now))
   OR (state = 'running' AND expires_at <= :now)
RETURNING token, expires_at, fence, attempts, takeovers, cancel, slot

-- name: record_published
-- A task is about to be published (lease_record_at_publish): its key's row, ready with the
-- message's task info, unless the key has one; the token continues after a retired one (the
-- first claim takes the next). sweep_at is when it becomes claimable (the message's
-- countdown): the sweeper re-publishes it a grace period after that if nobody claimed it.
INSERT INTO lease_celery_leases
       (key, state, owner, token, expires_at, attempts, takeovers, updated_at, task, sweep_at)
VALUES (:key, 'ready', NULL,
        COALESCE((SELECT token FROM lease_celery_retired WHERE key = :key), 0),
        NULL, 0, 0, :now, :task, :now + :countdown)
ON CONFLICT (key) DO NOTHING

-- name: renew
-- A running lease, or a finished one whose owner is still settling it (the deadline then
-- bounds the settle phase).
UPDATE lease_celery_leases
SET expires_at = :expires_at, updated_at = :now,
    sweep_at = CASE WHEN task IS NULL THEN NULL ELSE :expires_at END
WHERE key = :key AND (state = 'running' OR settling = 1) AND owner = :owner
  AND token = :token AND expires_at > :now
RETURNING expires_at, cancel

-- name: finish
-- :settle_deadline NULL: settled at once (no result backend or callbacks to wait for); else
-- the key is done and settling until its owner confirms (settle) or the deadline passes.
UPDATE lease_celery_leases
SET state = 'done', result = :result, updated_at = :now, reason = NULL,
    checkpoint = NULL, cancel = NULL,
    settling   = :settle_deadline IS NOT NULL,
    expires_at = COALESCE(:settle_deadline, :now),
    sweep_at   = CASE WHEN :settle_deadline IS NULL OR task IS NULL THEN NULL
                      ELSE :settle_deadline END,
    -- settled at once: keep only the task id and context (lease_celery.execution.answers)
    task       = CASE WHEN :settle_deadline IS NULL AND task IS NOT NULL
                      THEN json_patch(json_object('options', json_object('task_id', json_extract(task, '$.options.task_id'))), json_object('context', json_extract(task, '$.context'))) ELSE task END
WHERE key = :key AND state = 'running' AND owner = :owner AND token = :token
  AND expires_at > :now

-- name: settle
-- The owner confirms that Celery stored the outcome (and dispatched callbacks): the settle
-- phase ends, and a done row no longer needs the task it would have been re-published with.
UPDATE lease_celery_leases
SET settling = 0, sweep_at = NULL, updated_at = :now,
    -- a settled done row keeps only its task id and context (lease_celery.execution.answers)
    task = CASE WHEN state = 'done' AND task IS NOT NULL THEN json_patch(json_object('options', json_object('task_id', json_extract(task, '$.options.task_id'))), json_object('context', json_extract(task, '$.context'))) ELSE task END
WHERE key = :key AND settling = 1 AND owner = :owner AND token = :token

-- name: settled_by_owner
-- After a settle that changed nothing: did this very lease settle the row already? (The
-- confirmation is idempotent: a settled row keeps the owner and token that settled it.)
SELECT 1 FROM lease_celery_leases
WHERE key = :key AND settling = 0 AND state IN ('done', 'dead') AND owner = :owner
  AND token = :token

-- name: claim_settlement
-- A finished key whose owner neither confirmed nor renewed its settle phase before the
-- deadline is gone: this delivery completes it (same token; the owner becomes the completer).
UPDATE lease_celery_leases
SET owner = :owner, expires_at = :expires_at, updated_at = :now,
    sweep_at = CASE WHEN task IS NULL THEN NULL ELSE :expires_at END, swept_by = NULL
WHERE key = :key AND settling = 1 AND expires_at <= :now
RETURNING token, expires_at, fence, attempts, takeovers

-- name: release
-- Give back early; :not_before (or NULL) is the backoff before the next claim (or when a
-- retry is due). :task (or NULL: kept) is the message that claims it next; :given_back = 1
-- takes this claim's attempt back. The sweeper re-publishes the row if nobody claimed it a
-- grace period after it became claimable.
UPDATE lease_celery_leases
SET state = 'ready', expires_at = :now, updated_at = :now, not_before = :not_before,
    reason = :reason, swept_by = NULL, task = COALESCE(:task, task),
    attempts = attempts - :given_back,
    sweep_at = CASE WHEN COALESCE(:task, task) IS NULL THEN NULL
                    ELSE COALESCE(:not_before, :now) END
WHERE key = :key AND state = 'running' AND owner = :owner AND token = :token
  AND expires_at > :now

-- name: kill
-- The current holder gives up for good: dead until a person requeues it. The task info stays
-- (requeue re-publishes it); with :settle_deadline the owner settles the failure like a finish.
-- :error, the exception as Celery stores it, is the outcome a duplicate is answered with.
UPDATE lease_celery_leases
SET state = 'dead', updated_at = :now, reason = :reason, result = :error,
    settling   = :settle_deadline IS NOT NULL,
    expires_at = COALESCE(:settle_deadline, :now),
    sweep_at   = CASE WHEN :settle_deadline IS NULL OR task IS NULL THEN NULL
                      ELSE :settle_deadline END
WHERE key = :key AND state = 'running' AND owner = :owner AND token = :token
  AND expires_at > :now

-- name: force_release
-- An operator's override: a running row becomes ready whoever holds it. The holder's renew and
-- finish then fail (state is no longer running), so its result is refused.
UPDATE lease_celery_leases
SET state = 'ready', expires_at = :now, updated_at = :now, not_before = NULL, reason = :reason,
    sweep_at = CASE WHEN task IS NULL THEN NULL ELSE :now END, swept_by = NULL
WHERE key = :key AND state = 'running'

-- name: requeue
-- dead -> ready with a fresh budget of attempts; the token continues.
UPDATE lease_celery_leases
SET state = 'ready', attempts = 0, takeovers = 0, not_before = NULL, updated_at = :now,
    reason = :reason, settling = 0, swept_by = NULL, cancel = NULL,
    sweep_at = CASE WHEN task IS NULL THEN NULL ELSE :now END
WHERE key = :key AND state = 'dead'
RETURNING task

-- name: sweep_candidates
-- What the sweeper may act on, read through the partial index on sweep_at (only rows that are
-- not terminal and carry task info are in it): a running lease or a settle phase past its
-- deadline (its owner is gone), or a ready row nobody claimed a grace period after it became
-- claimable (its message was lost). A re-publish moves sweep_at a grace period on, so a
-- sweeper that dies between the mark and the publish leaves a mark that expires.
SELECT key FROM lease_celery_leases
WHERE sweep_at IS NOT NULL AND sweep_at <= :now
  AND (((state = 'running' OR settling = 1) AND expires_at <= :now)
       OR (state = 'ready' AND sweep_at <= :now - :grace))
ORDER BY sweep_at LIMIT :limit

-- name: sweep_mark
-- One sweeper re-publishes each due row per grace period: the mark is conditional on it being
-- due, and moves its next look on (ready rows: due again a grace period from now).
UPDATE lease_celery_leases
SET sweep_at = CASE WHEN state = 'ready' THEN :now ELSE :now + :grace END, swept_by = :nonce
WHERE key = :key AND sweep_at IS NOT NULL AND sweep_at <= :now
  AND (((state = 'running' OR settling = 1) AND expires_at <= :now)
       OR (state = 'ready' AND sweep_at <= :now - :grace))
RETURNING token, task

-- name: sweep_unmark
-- The re-publish failed: let the next sweep try this row again (as due as before the mark).
UPDATE lease_celery_leases
SET sweep_at = CASE WHEN state = 'ready' THEN COALESCE(not_before, 0) ELSE expires_at END,
    swept_by = NULL
WHERE key = :key AND token = :token AND swept_by IS NOT NULL AND sweep_at IS NOT NULL

-- name: list_arm
-- find(): the rows of one index, newest first. {where} is a literal predicate on state
-- (lease_celery.stores.sql_glue.FIND_ARMS, never user data): with a literal the planner can
-- prove the partial index's own predicate, which it cannot for a parameter.
SELECT key, state, owner, token, expires_at, attempts, result, updated_at, fence, takeovers,
       not_before, reason, task, settling, checkpoint, cancel
FROM lease_celery_leases
WHERE {where}
  AND (:prefix IS NULL OR substr(key, 1, length(:prefix)) = :prefix)
  AND (:owner IS NULL OR owner = :owner OR substr(owner, 1, length(:owner) + 1) = :owner || '/')
ORDER BY updated_at DESC
LIMIT :limit

-- name: list_merge
-- find() without a state: the newest of each index's newest (the arms above, one per {arm}).
SELECT * FROM ({ready}) UNION ALL SELECT * FROM ({running}) UNION ALL SELECT * FROM ({settled})
ORDER BY updated_at DESC
LIMIT :limit

-- name: stats
-- Counted through the indexes, never the table: ready rows in the live index alone; running
-- rows (as many as the workers' concurrency) read for their expires_at; dead rows in the dead
-- index; done ones as the terminal index's plain count less the dead (at a million rows 39 ms,
-- where its GROUP BY state took 340 and the table's 450). A state without rows is left out, as
-- GROUP BY would.
WITH dead AS (SELECT count(*) AS n FROM lease_celery_leases WHERE state = 'dead'),
     settled AS (SELECT count(*) AS n FROM lease_celery_leases WHERE state IN ('done', 'dead'))
SELECT 'ready' AS state, count(*) AS total, 0 AS expired FROM lease_celery_leases
WHERE state IN ('ready', 'running') AND state = 'ready' HAVING count(*) > 0
UNION ALL
SELECT 'running', count(*), sum(expires_at <= :now) FROM lease_celery_leases
WHERE state IN ('ready', 'running') AND state = 'running' HAVING count(*) > 0
UNION ALL
SELECT 'dead', n, 0 FROM dead WHERE n > 0
UNION ALL
SELECT 'done', settled.n - dead.n, 0 FROM settled, dead WHERE settled.n > dead.n

-- name: retire_old
-- purge_older_than, step 1: remember the tokens of the oldest settled done/dead rows (at most
-- :limit, -1 for all; read through the partial index on terminal rows).
INSERT INTO lease_celery_retired (key, token)
SELECT key, token FROM lease_celery_leases
WHERE key IN (SELECT key FROM lease_celery_leases
              WHERE state IN ('done', 'dead') AND updated_at < :cutoff AND settling = 0
              ORDER BY updated_at LIMIT :limit)
ON CONFLICT (key) DO UPDATE SET token = max(token, excluded.token)

-- name: purge_old
-- purge_older_than, step 2 (same transaction, so the same rows).
DELETE FROM lease_celery_leases
WHERE key IN (SELECT key FROM lease_celery_leases
              WHERE state IN ('done', 'dead') AND updated_at < :cutoff AND settling = 0
              ORDER BY updated_at LIMIT :limit)

-- name: get
SELECT key, state, owner, token, expires_at, attempts, result, updated_at, fence, takeovers,
       not_before, reason, task, settling, checkpoint, cancel
FROM lease_celery_leases WHERE key = :key

-- name: checkpoint
-- Fenced like finish: only the current holder's progress is written.
UPDATE lease_celery_leases SET checkpoint = :checkpoint
WHERE key = :key AND state = 'running' AND owner = :owner AND token = :token
  AND expires_at > :now

-- name: cancel_held
-- An operator's cancel reaches a live holder through its next renewal.
UPDATE lease_celery_leases SET cancel = :reason
WHERE key = :key AND state = 'running' AND expires_at > :now

-- name: cancel_idle
-- A key nobody holds (no row yet, ready, or an expired lease) is cancelled at once: dead, so
-- no delivery runs its body. Its token stays (a new row starts at its retired token).
INSERT INTO lease_celery_leases
       (key, state, owner, token, expires_at, attempts, takeovers, reason, updated_at, cancel)
VALUES (:key, 'dead', NULL, COALESCE((SELECT token FROM lease_celery_retired WHERE key = :key), 0),
        :now, 0, 0, :reason, :now, :reason)
ON CONFLICT (key) DO UPDATE SET
    state = 'dead', reason = excluded.reason, cancel = excluded.cancel, updated_at = :now,
    expires_at = :now, not_before = NULL, settling = 0, sweep_at = NULL, swept_by = NULL
WHERE state = 'ready' OR (state = 'running' AND expires_at <= :now)

-- name: leases_table_exists
-- Read through the app's connection before its first write there (Store.lock_in and co.).
SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'lease_celery_leases'

-- name: lock_current
-- The fencing predicate, in the app's own transaction on this file (Store.lock_in): a write
-- that changes nothing (so no history entry), made to take the file's write lock there, so
-- that no claim can commit until the app's transaction ends.
UPDATE lease_celery_leases SET token = token
WHERE key = :key AND state = 'running' AND owner = :owner AND token = :token
  AND expires_at > :now

-- name: check_current
-- The fencing predicate for store.fenced(); BEGIN IMMEDIATE already holds the write lock, so no
-- claim can interleave until the caller's transaction ends.
SELECT token FROM lease_celery_leases
WHERE key = :key AND state = 'running' AND owner = :owner AND token = :token
  AND expires_at > :now

-- name: retire
-- purge, step 1 (same transaction as step 2): remember the token of a row that is not held.
INSERT INTO lease_celery_retired (key, token)
SELECT key, token FROM lease_celery_leases
WHERE key = :key AND (state <> 'running' OR expires_at <= :now)
ON CONFLICT (key) DO UPDATE SET token = max(token, excluded.token)

-- name: purge
-- purge, step 2: delete the row unless a live lease holds it.
DELETE FROM lease_celery_leases
WHERE key = :key AND (state <> 'running' OR expires_at <= :now)

-- name: effect_insert
INSERT INTO lease_celery_effects (key, fingerprint, state, lease_key, lease_token, lease_owner,
                                  started_at, attempts, result, version, updated_at)
VALUES (:key, :fingerprint, 'in_flight', :lease_key, :lease_token, :lease_owner,
        :now, 1, NULL, 1, :now)
ON CONFLICT (key) DO NOTHING

-- name: effect_get
SELECT key, fingerprint, state, lease_key, lease_token, lease_owner, started_at, attempts,
       result, version, updated_at
FROM lease_celery_effects WHERE key = :key

-- name: effect_find
-- Operators' listing of one state (the reconciliation queue), newest first: a range of the
-- state index read backwards. A statement of its own, apart from effect_find_any: SQLite plans
-- a statement before its parameters are bound, so one statement for both, "the parameter IS
-- NULL OR state = the parameter", read the whole table.
SELECT key, fingerprint, state, lease_key, lease_token, lease_owner, started_at, attempts,
       result, version, updated_at
FROM lease_celery_effects WHERE state = :state
ORDER BY updated_at DESC LIMIT :limit

-- name: effect_find_any
-- Receipts of every state, newest first.
SELECT key, fingerprint, state, lease_key, lease_token, lease_owner, started_at, attempts,
       result, version, updated_at
FROM lease_celery_effects
ORDER BY updated_at DESC LIMIT :limit

-- name: effect_update
UPDATE lease_celery_effects
SET state = :state, result = :result, version = version + 1, updated_at = :now
WHERE key = :key AND version = :version

-- name: effect_restart
UPDATE lease_celery_effects
SET state = 'in_flight', lease_key = :lease_key, lease_token = :lease_token,
    lease_owner = :lease_owner, started_at = :now, attempts = attempts + 1,
    version = version + 1, updated_at = :now
WHERE key = :key AND version = :version

-- name: effect_delete
DELETE FROM lease_celery_effects WHERE key = :key AND version = :version
