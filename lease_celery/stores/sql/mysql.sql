-- MySQL / MariaDB dialect (PyMySQL, %(name)s parameters). {now} and {clock} are replaced by the
-- store with COALESCE(%(now)s, <the server's clock>): the injected clock of a store opened with
-- one, else the server's, as UTC epoch seconds (the sessions' time zone is +00:00). {now} is
-- UNIX_TIMESTAMP(NOW(6)), the instant the statement started, one value for every column it
-- sets; {clock} is UNIX_TIMESTAMP(SYSDATE(6)), the instant it is evaluated, for the fencing
-- predicates: a statement that waited for a row lock judges the row at the later instant it
-- got it (a finish that waited past its deadline is refused).
-- {collation} is the server's binary, no-pad collation (utf8mb4_nopad_bin): keys and owners compare byte for byte, 'k' and 'k ' are two keys.
-- `key` is a reserved word: quoted everywhere. The sessions run READ COMMITTED (see
-- lease_celery/stores/mysql.py): no gap locks, each statement reads the latest committed rows.
-- Times are epoch seconds (DOUBLE), as everywhere in the library; PyMySQL sends a float as a
-- DOUBLE literal (1e0), so arithmetic is the same binary floating point as Python's.

-- name: lock_schema
-- Workers starting at once: one makes (or migrates) the schema, the others wait for it.
SELECT GET_LOCK(CONCAT('lease_celery.schema:', DATABASE()), 30) AS got

-- name: unlock_schema
SELECT RELEASE_LOCK(CONCAT('lease_celery.schema:', DATABASE()))

-- name: server
SELECT VERSION() AS version

-- name: create_leases
-- 'purged': a tombstone that keeps the key's token after purge; never shown. The *_at
-- generated columns stand in for PostgreSQL's partial indexes: each is NULL outside the rows
-- its index is for, and the reads name them (terminal_at: settled done/dead rows, retention;
-- dead_at: dead rows).
CREATE TABLE IF NOT EXISTS lease_celery_leases (
    `key`       VARCHAR(512)  NOT NULL PRIMARY KEY,
    state       VARCHAR(8)    NOT NULL
                CHECK (state IN ('ready', 'running', 'done', 'dead', 'purged')),
    owner       TEXT,
    token       BIGINT        NOT NULL CHECK (token >= 0),
    expires_at  DOUBLE,
    attempts    INT           NOT NULL DEFAULT 0,
    takeovers   INT           NOT NULL DEFAULT 0,
    not_before  DOUBLE,
    reason      LONGTEXT,
    task        LONGTEXT,
    swept_token BIGINT,
    nonce       VARCHAR(64),
    result      LONGTEXT,
    updated_at  DOUBLE        NOT NULL,
    fence       BIGINT        NOT NULL DEFAULT 0,
    settling    TINYINT       NOT NULL DEFAULT 0,
    sweep_at    DOUBLE,
    swept_by    VARCHAR(64),
    checkpoint  LONGTEXT,
    cancel      LONGTEXT,
    grp         VARCHAR(255),
    slot        BIGINT,
    terminal_at DOUBLE AS (IF(state IN ('done', 'dead') AND settling = 0, updated_at, NULL))
                STORED,
    dead_at     DOUBLE AS (IF(state = 'dead', updated_at, NULL)) STORED,
    KEY lease_celery_leases_sweep (sweep_at),
    KEY lease_celery_leases_state (state, updated_at),
    KEY lease_celery_leases_terminal (terminal_at),
    KEY lease_celery_leases_dead (dead_at),
    KEY lease_celery_leases_slots (grp, state, expires_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = {collation}

-- name: create_fence
-- The store-wide fence: a sequence drawn by every claim outside any transaction's locks
-- (gaps are harmless, order is not lost), as PostgreSQL's.
CREATE SEQUENCE IF NOT EXISTS lease_celery_fence ENGINE = InnoDB

-- name: create_history
-- Every event of every key (lease_celery.history), in insertion order (id).
CREATE TABLE IF NOT EXISTS lease_celery_history (
    id      BIGINT        NOT NULL AUTO_INCREMENT PRIMARY KEY,
    `key`   VARCHAR(512)  NOT NULL,
    at      DOUBLE        NOT NULL,
    event   VARCHAR(32)   NOT NULL,
    owner   TEXT,
    token   BIGINT,
    fence   BIGINT,
    detail  LONGTEXT,
    KEY lease_celery_history_key (`key`, at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = {collation}

-- name: drop_history_on_claim
DROP TRIGGER IF EXISTS lease_celery_history_new_key

-- name: create_history_on_claim
-- The store writes each key's transitions into its history itself, in the statement that
-- makes them (a trigger: same transaction, no round trip, nothing a crash can lose), as the
-- other SQL stores do since schema 5. Events that are no transition of the row are written by
-- lease_celery.history.
CREATE TRIGGER lease_celery_history_new_key
AFTER INSERT ON lease_celery_leases FOR EACH ROW
INSERT INTO lease_celery_history (`key`, at, event, owner, token, fence, detail)
SELECT NEW.`key`, NEW.updated_at, 'claimed', NEW.owner, NEW.token, NEW.fence, NULL
FROM DUAL WHERE NEW.state = 'running'

-- name: drop_history_on_transition
DROP TRIGGER IF EXISTS lease_celery_history_transition

-- name: create_history_on_transition
-- A new token is a claim (a takeover if the row was running: its lease had lapsed); running ->
-- done a finish; -> dead with its reason; running -> ready a release, or a retry when a backoff
-- follows; a settling row changing owner a completion. Renewals, settle confirmations and
-- checkpoints match none and write nothing.
CREATE TRIGGER lease_celery_history_transition
AFTER UPDATE ON lease_celery_leases FOR EACH ROW
INSERT INTO lease_celery_history (`key`, at, event, owner, token, fence, detail)
SELECT NEW.`key`, NEW.updated_at, t.event, NEW.owner, NEW.token, NEW.fence, t.detail FROM (
    SELECT CASE
             WHEN NEW.token <> OLD.token AND OLD.state = 'running' THEN 'taken_over'
             WHEN NEW.token <> OLD.token THEN 'claimed'
             WHEN NEW.state = 'done' AND OLD.state = 'running' THEN 'finished'
             WHEN NEW.state = 'dead' AND OLD.state <> 'dead' THEN 'dead'
             WHEN NEW.state = 'ready' AND OLD.state = 'running'
                  AND NEW.not_before > NEW.updated_at THEN 'retry'
             WHEN NEW.state = 'ready' AND OLD.state = 'running' THEN 'released'
             WHEN NEW.settling = 1 AND OLD.settling = 1
                  AND NOT (NEW.owner <=> OLD.owner) THEN 'completed'
           END AS event,
           CASE
             WHEN NEW.token <> OLD.token AND OLD.state = 'running'
                  THEN CONCAT('the lease of ', COALESCE(OLD.owner, '?'), ' (token ', OLD.token,
                              ') had lapsed')
             WHEN NEW.token <> OLD.token THEN NULL
             WHEN NEW.state = 'done' AND OLD.state = 'running' THEN NULL
             WHEN NEW.state = 'dead' AND OLD.state <> 'dead' THEN NEW.reason
             WHEN NEW.state = 'ready' AND OLD.state = 'running'
                  AND NEW.not_before > NEW.updated_at
                  THEN CONCAT(COALESCE(NEW.reason, 'released'), '; claimable again in ',
                              CAST(ROUND(NEW.not_before - NEW.updated_at, 2) AS DECIMAL(30, 2)),
                              's')
             WHEN NEW.state = 'ready' AND OLD.state = 'running' THEN NEW.reason
             WHEN NEW.settling = 1 AND OLD.settling = 1
                  THEN CONCAT('its owner ', COALESCE(OLD.owner, '?'), ' left the ', NEW.state,
                              ' key unsettled: completed by this delivery')
           END AS detail) AS t
WHERE t.event IS NOT NULL

-- name: history_insert
INSERT INTO lease_celery_history (`key`, at, event, owner, token, fence, detail)
VALUES (%s, %s, %s, %s, %s, %s, %s)

-- name: history_of
SELECT `key`, at, event, owner, token, fence, detail FROM (
    SELECT * FROM lease_celery_history WHERE `key` = %(key)s
    ORDER BY at DESC, id DESC LIMIT %(limit)s) AS h
ORDER BY at, id

-- name: history_many
-- history_of for every key of {keys} (a list of placeholders the store writes) at once.
SELECT `key`, at, event, owner, token, fence, detail FROM (
    SELECT h.*, ROW_NUMBER() OVER (PARTITION BY `key` ORDER BY at DESC, id DESC) AS r
    FROM lease_celery_history AS h WHERE `key` IN ({keys})) AS h
WHERE r <= %(limit)s
ORDER BY `key`, at, id

-- name: history_recent
SELECT `key`, at, event, owner, token, fence, detail FROM (
    SELECT * FROM lease_celery_history
    WHERE {events}
    ORDER BY id DESC LIMIT %(limit)s) AS latest
ORDER BY at DESC, id DESC

-- name: history_prune
-- The oldest entries first, by insertion order: a batch reads the table's first `limit` ids
-- and deletes those older than the cutoff (MySQL refuses LIMIT in an IN subquery: a join).
DELETE h FROM lease_celery_history AS h
JOIN (SELECT id FROM lease_celery_history ORDER BY id LIMIT %(limit)s) AS first USING (id)
WHERE h.at < %(cutoff)s

-- name: create_effects
-- lease_celery_effects_state (schema 8): the receipts of one state (the reconcile queue) are a
-- range of it, newest first; without it a rare state was found by reading every receipt.
CREATE TABLE IF NOT EXISTS lease_celery_effects (
    `key`        VARCHAR(512)  NOT NULL PRIMARY KEY,
    fingerprint  TEXT          NOT NULL,
    state        VARCHAR(24)   NOT NULL
                 CHECK (state IN ('in_flight', 'done', 'needs_reconciliation')),
    lease_key    VARCHAR(512),
    lease_token  BIGINT,
    lease_owner  TEXT,
    started_at   DOUBLE        NOT NULL,
    attempts     INT           NOT NULL,
    result       LONGTEXT,
    version      BIGINT        NOT NULL,
    updated_at   DOUBLE        NOT NULL,
    KEY lease_celery_effects_updated (updated_at),
    KEY lease_celery_effects_state (state, updated_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = {collation}

-- name: migrate_effects_state_index
-- Schema 7 -> 8: the state index create_effects now makes.
CREATE INDEX IF NOT EXISTS lease_celery_effects_state ON lease_celery_effects
(state, updated_at)

-- name: create_meta
CREATE TABLE IF NOT EXISTS lease_celery_meta (
    name  VARCHAR(64) NOT NULL PRIMARY KEY,
    value TEXT        NOT NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = {collation}

-- name: create_limits
-- One row per limit group (as in postgres.sql). A limited claim locks its group's row: the
-- claims of one group are serialised, no others.
CREATE TABLE IF NOT EXISTS lease_celery_limits (
    grp           VARCHAR(255) NOT NULL PRIMARY KEY,
    task_limit    INT,
    task_rate     TEXT,
    task_interval DOUBLE,
    set_limit     INT,
    set_rate      TEXT,
    set_interval  DOUBLE,
    tat           DOUBLE,
    slots         BIGINT       NOT NULL DEFAULT 0,
    seq           BIGINT       NOT NULL DEFAULT 0,
    updated_at    DOUBLE       NOT NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = {collation}

-- name: create_waiters
CREATE TABLE IF NOT EXISTS lease_celery_waiters (
    grp        VARCHAR(255) NOT NULL,
    `key`      VARCHAR(512) NOT NULL,
    seq        BIGINT       NOT NULL,
    task       LONGTEXT,
    since      DOUBLE       NOT NULL,
    handed_at  DOUBLE,
    PRIMARY KEY (grp, `key`),
    KEY lease_celery_waiters_order (grp, seq)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = {collation}

-- name: get_schema_version
SELECT value FROM lease_celery_meta WHERE name = 'schema_version'

-- name: set_schema_version
INSERT INTO lease_celery_meta (name, value) VALUES ('schema_version', %(version)s)
ON DUPLICATE KEY UPDATE value = VALUES(value)

-- name: now
SELECT {now} AS now

-- name: claim
-- One statement. A new key starts at token 1; an existing row is locked and judged in its
-- latest committed version, and taken only when purged, ready and past its backoff, or running
-- with an expired lease (expires_at <= now: a takeover). MySQL runs the SET list left to right,
-- each assignment seeing the ones before it: the first takes the verdict on the row as it was
-- and records it as this call's nonce; every later one asks whether the nonce is this call's.
-- A refused claim changes no column: affected rows 0 (1 inserted, 2 taken over).
INSERT INTO lease_celery_leases
       (`key`, state, owner, token, expires_at, attempts, takeovers, result, updated_at, fence,
        task, nonce, sweep_at, grp, slot)
VALUES (%(key)s, 'running', %(owner)s, 1, {now} + %(ttl)s, 1, 0, NULL, {now},
        NEXTVAL(lease_celery_fence), %(task)s, %(nonce)s,
        IF(%(task)s IS NULL, NULL, {now} + %(ttl)s), %(grp)s, %(slot)s)
ON DUPLICATE KEY UPDATE
    nonce      = IF(state = 'purged'
                    OR (state = 'ready' AND (not_before IS NULL OR not_before <= {clock}))
                    OR (state = 'running' AND expires_at <= {clock}),
                    VALUES(nonce), nonce),
    takeovers  = IF(nonce <=> VALUES(nonce),
                    CASE WHEN state = 'running' THEN takeovers + 1
                         WHEN state = 'purged' THEN 0 ELSE takeovers END, takeovers),
    attempts   = IF(nonce <=> VALUES(nonce), IF(state = 'purged', 1, attempts + 1), attempts),
    state      = IF(nonce <=> VALUES(nonce), 'running', state),
    owner      = IF(nonce <=> VALUES(nonce), VALUES(owner), owner),
    token      = IF(nonce <=> VALUES(nonce), token + 1, token),
    expires_at = IF(nonce <=> VALUES(nonce), VALUES(expires_at), expires_at),
    not_before = IF(nonce <=> VALUES(nonce), NULL, not_before),
    result     = IF(nonce <=> VALUES(nonce), NULL, result),
    updated_at = IF(nonce <=> VALUES(nonce), VALUES(updated_at), updated_at),
    fence      = IF(nonce <=> VALUES(nonce), VALUES(fence), fence),
    task       = IF(nonce <=> VALUES(nonce), VALUES(task), task),
    settling   = IF(nonce <=> VALUES(nonce), 0, settling),
    sweep_at   = IF(nonce <=> VALUES(nonce), VALUES(sweep_at), sweep_at),
    swept_by   = IF(nonce <=> VALUES(nonce), NULL, swept_by),
    grp        = IF(nonce <=> VALUES(nonce), VALUES(grp), grp),
    slot       = IF(nonce <=> VALUES(nonce), VALUES(slot), slot)

-- name: claimed_by
-- The row a claim call (its nonce) took: read back in the claim's own transaction, or after a
-- lost reply (did the first send win?).
SELECT token, expires_at, fence, attempts, takeovers, cancel, slot
FROM lease_celery_leases
WHERE `key` = %(key)s AND state = 'running' AND owner = %(owner)s AND nonce = %(nonce)s

-- name: record_published
-- A task is about to be published: its key's row, ready with the message's task info, unless
-- the key has one (a purged key's tombstone is taken over, its token kept). Affected rows: 1
-- inserted, 2 a tombstone taken over, 0 the key had a row.
INSERT INTO lease_celery_leases
       (`key`, state, owner, token, expires_at, attempts, takeovers, updated_at, task, sweep_at,
        nonce)
VALUES (%(key)s, 'ready', NULL, 0, NULL, 0, 0, {now}, %(task)s, {now} + %(countdown)s,
        %(nonce)s)
ON DUPLICATE KEY UPDATE
    nonce      = IF(state = 'purged', VALUES(nonce), nonce),
    state      = IF(nonce <=> VALUES(nonce), 'ready', state),
    owner      = IF(nonce <=> VALUES(nonce), NULL, owner),
    expires_at = IF(nonce <=> VALUES(nonce), NULL, expires_at),
    attempts   = IF(nonce <=> VALUES(nonce), 0, attempts),
    takeovers  = IF(nonce <=> VALUES(nonce), 0, takeovers),
    fence      = IF(nonce <=> VALUES(nonce), 0, fence),
    not_before = IF(nonce <=> VALUES(nonce), NULL, not_before),
    reason     = IF(nonce <=> VALUES(nonce), NULL, reason),
    result     = IF(nonce <=> VALUES(nonce), NULL, result),
    checkpoint = IF(nonce <=> VALUES(nonce), NULL, checkpoint),
    cancel     = IF(nonce <=> VALUES(nonce), NULL, cancel),
    settling   = IF(nonce <=> VALUES(nonce), 0, settling),
    swept_by   = IF(nonce <=> VALUES(nonce), NULL, swept_by),
    swept_token = IF(nonce <=> VALUES(nonce), NULL, swept_token),
    updated_at = IF(nonce <=> VALUES(nonce), VALUES(updated_at), updated_at),
    task       = IF(nonce <=> VALUES(nonce), VALUES(task), task),
    sweep_at   = IF(nonce <=> VALUES(nonce), VALUES(sweep_at), sweep_at)

-- name: published_already
SELECT `key` FROM lease_celery_leases
WHERE `key` = %(key)s AND state = 'ready' AND attempts = 0 AND nonce = %(nonce)s

-- name: renew
-- A running lease, or a finished one whose owner is still settling it (the deadline then
-- bounds the settle phase); %(at)s is the instant read once for the batch, the predicate
-- reads the clock itself.
UPDATE lease_celery_leases
SET expires_at = %(at)s + %(ttl)s, updated_at = %(at)s,
    sweep_at = IF(task IS NULL, NULL, %(at)s + %(ttl)s)
WHERE `key` = %(key)s AND (state = 'running' OR settling = 1) AND owner = %(owner)s
  AND token = %(token)s AND expires_at > {clock}

-- name: renewed
SELECT expires_at, cancel FROM lease_celery_leases WHERE `key` = %(key)s

-- name: fragment_task_id_only
-- A settled done row keeps only its task id and context (lease_celery.execution.answers).
IF(JSON_VALUE(task, '$.context') IS NULL,
   JSON_OBJECT('options', JSON_OBJECT('task_id', JSON_VALUE(task, '$.options.task_id'))),
   JSON_OBJECT('options', JSON_OBJECT('task_id', JSON_VALUE(task, '$.options.task_id')),
               'context', JSON_VALUE(task, '$.context')))

-- name: finish
-- %(settle_within)s NULL: settled at once; else done and settling until the owner confirms
-- (settle) or the settle deadline passes. The task column is set first: it reads the
-- settling value the row had, never one set here.
UPDATE lease_celery_leases
SET task       = IF(%(settle_within)s IS NULL AND task IS NOT NULL,
                    {fragment_task_id_only}
                    , task),
    state = 'done', result = %(result)s, updated_at = {now}, reason = NULL,
    checkpoint = NULL, cancel = NULL,
    settling   = %(settle_within)s IS NOT NULL,
    expires_at = {now} + COALESCE(%(settle_within)s, 0),
    sweep_at   = IF(%(settle_within)s IS NULL OR task IS NULL, NULL,
                    {now} + %(settle_within)s)
WHERE `key` = %(key)s AND state = 'running' AND owner = %(owner)s AND token = %(token)s
  AND expires_at > {clock}

-- name: settle
-- The owner confirms that Celery stored the outcome (and dispatched callbacks).
UPDATE lease_celery_leases
SET task = IF(state = 'done' AND task IS NOT NULL,
              {fragment_task_id_only}
              , task),
    settling = 0, sweep_at = NULL, updated_at = {now}
WHERE `key` = %(key)s AND settling = 1 AND owner = %(owner)s AND token = %(token)s

-- name: settled_by_owner
-- After a settle that changed nothing: did this very lease settle the row already?
SELECT 1 AS settled FROM lease_celery_leases
WHERE `key` = %(key)s AND settling = 0 AND state IN ('done', 'dead') AND owner = %(owner)s
  AND token = %(token)s

-- name: claim_settlement
-- A finished key whose owner neither confirmed nor renewed the settle phase before its
-- deadline is gone: this delivery completes it (same token; the owner becomes the completer).
UPDATE lease_celery_leases
SET owner = %(owner)s, expires_at = {now} + %(ttl)s, updated_at = {now},
    sweep_at = IF(task IS NULL, NULL, {now} + %(ttl)s), swept_by = NULL, nonce = %(nonce)s
WHERE `key` = %(key)s AND settling = 1 AND expires_at <= {clock}

-- name: settlement_claimed_by
SELECT token, expires_at, fence, attempts, takeovers
FROM lease_celery_leases
WHERE `key` = %(key)s AND settling = 1 AND owner = %(owner)s AND nonce = %(nonce)s

-- name: release
-- Give back early; %(delay)s > 0 sets the backoff. %(task)s (or NULL: kept) is the message that
-- claims it next; %(given_back)s = 1 takes this claim's attempt back. sweep_at reads the task
-- as it was (assigned before task).
UPDATE lease_celery_leases
SET sweep_at = IF(COALESCE(%(task)s, task) IS NULL, NULL, {now} + GREATEST(%(delay)s, 0)),
    state = 'ready', expires_at = {now}, updated_at = {now}, reason = %(reason)s,
    not_before = IF(%(delay)s > 0, {now} + %(delay)s, NULL),
    task = COALESCE(%(task)s, task),
    attempts = attempts - %(given_back)s,
    swept_by = NULL
WHERE `key` = %(key)s AND state = 'running' AND owner = %(owner)s AND token = %(token)s
  AND expires_at > {clock}

-- name: kill
-- The current holder gives up for good: dead until a person requeues it.
UPDATE lease_celery_leases
SET state = 'dead', updated_at = {now}, reason = %(reason)s, result = %(error)s,
    settling   = %(settle_within)s IS NOT NULL,
    expires_at = {now} + COALESCE(%(settle_within)s, 0),
    sweep_at   = IF(%(settle_within)s IS NULL OR task IS NULL, NULL,
                    {now} + %(settle_within)s)
WHERE `key` = %(key)s AND state = 'running' AND owner = %(owner)s AND token = %(token)s
  AND expires_at > {clock}

-- name: force_release
-- An operator's override: a running row becomes ready whoever holds it.
UPDATE lease_celery_leases
SET state = 'ready', expires_at = {now}, updated_at = {now}, not_before = NULL,
    reason = %(reason)s, swept_by = NULL, sweep_at = IF(task IS NULL, NULL, {now})
WHERE `key` = %(key)s AND state = 'running'

-- name: requeue
-- dead -> ready with a fresh budget of attempts; the token continues.
UPDATE lease_celery_leases
SET state = 'ready', attempts = 0, takeovers = 0, not_before = NULL, updated_at = {now},
    reason = %(reason)s, settling = 0, swept_by = NULL, cancel = NULL,
    sweep_at = IF(task IS NULL, NULL, {now})
WHERE `key` = %(key)s AND state = 'dead'

-- name: fragment_sweep_due
-- Not a query: a row the sweeper may act on (a running lease or a settle phase past its
-- deadline, or a ready row nobody claimed a grace period after it became claimable).
sweep_at IS NOT NULL AND sweep_at <= %(at)s
AND (((state = 'running' OR settling = 1) AND expires_at <= %(at)s)
     OR (state = 'ready' AND sweep_at <= %(at)s - %(grace)s))

-- name: sweep_candidates
-- Read through the index on sweep_at, locked; SKIP LOCKED lets concurrent sweepers (and a
-- claim holding a row) split the rows instead of queueing behind each other.
SELECT `key` FROM lease_celery_leases
WHERE
    {fragment_sweep_due}
ORDER BY sweep_at LIMIT %(limit)s
FOR UPDATE SKIP LOCKED

-- name: sweep_mark
-- The candidates, already locked by this transaction: the mark moves their next look a grace
-- period on, and records this call (a re-sent sweep reports exactly its own rows).
UPDATE lease_celery_leases
SET sweep_at = IF(state = 'ready', %(at)s, %(at)s + %(grace)s), swept_by = %(nonce)s
WHERE `key` IN ({keys}) AND
    {fragment_sweep_due}

-- name: swept_already
SELECT `key` FROM lease_celery_leases WHERE swept_by = %(nonce)s
ORDER BY sweep_at LIMIT %(limit)s

-- name: sweep_unmark
-- The re-publish failed: let the next sweep try this row again (as due as before the mark).
UPDATE lease_celery_leases
SET sweep_at = IF(state = 'ready', COALESCE(not_before, 0), expires_at), swept_by = NULL
WHERE `key` = %(key)s AND token = %(token)s AND swept_by IS NOT NULL AND sweep_at IS NOT NULL

-- name: list_arm
-- find(): the rows of one state, newest first, through the (state, updated_at) index. The
-- predicate on state below is a literal (sql_glue.FIND_ARMS, never user data).
SELECT `key`, state, owner, token, expires_at, attempts, result, updated_at, fence, takeovers,
       not_before, reason, task, settling, checkpoint, cancel
FROM lease_celery_leases FORCE INDEX (lease_celery_leases_state)
WHERE {where}
  AND (%(prefix)s IS NULL OR LEFT(`key`, CHAR_LENGTH(%(prefix)s)) = %(prefix)s)
  AND (%(owner)s IS NULL OR owner = %(owner)s
       OR LEFT(owner, CHAR_LENGTH(%(owner)s) + 1) = CONCAT(%(owner)s, '/'))
ORDER BY updated_at DESC
LIMIT %(limit)s

-- name: list_merge
-- find() without a state: the newest of each arm's newest, an arm per state (the store puts
-- the four arms in below, lease_celery/stores/mysql.py).
SELECT * FROM ({arms}) AS merged
ORDER BY updated_at DESC
LIMIT %(limit)s

-- name: stats
-- Counted in the (state, updated_at) index, one range per state, never the table's rows but
-- the running ones (as many as the workers' concurrency), read for their expires_at.
SELECT 'ready' AS state, count(*) AS total, 0 AS expired FROM lease_celery_leases
WHERE state = 'ready' HAVING count(*) > 0
UNION ALL
SELECT 'running', count(*), COALESCE(SUM(expires_at <= {clock}), 0) FROM lease_celery_leases
WHERE state = 'running' HAVING count(*) > 0
UNION ALL
SELECT 'done', count(*), 0 FROM lease_celery_leases WHERE state = 'done' HAVING count(*) > 0
UNION ALL
SELECT 'dead', count(*), 0 FROM lease_celery_leases WHERE state = 'dead' HAVING count(*) > 0

-- name: purge_old_candidates
-- The oldest settled done/dead rows (at most %(limit)s), through the terminal_at index,
-- locked; rows another transaction holds are left for the next batch.
SELECT `key` FROM lease_celery_leases
WHERE terminal_at IS NOT NULL AND terminal_at < {clock} - %(seconds)s
ORDER BY terminal_at LIMIT %(limit)s
FOR UPDATE SKIP LOCKED

-- name: fragment_tombstone
-- Not a query: what a purge leaves of a row: key and token, so tokens never restart.
state = 'purged', owner = NULL, result = NULL, task = NULL, reason = NULL,
checkpoint = NULL, cancel = NULL, not_before = NULL, swept_token = NULL, settling = 0,
sweep_at = NULL, swept_by = NULL, updated_at = {now}

-- name: purge_old
UPDATE lease_celery_leases SET
    {fragment_tombstone}
WHERE `key` IN ({keys}) AND state IN ('done', 'dead') AND settling = 0

-- name: purge
-- Tombstone the row unless a live lease holds it.
UPDATE lease_celery_leases SET
    {fragment_tombstone}
WHERE `key` = %(key)s AND state <> 'purged' AND (state <> 'running' OR expires_at <= {clock})

-- name: lock_current
-- The fencing predicate under a row lock, for store.fenced(): no claim can take the row over
-- until the caller's transaction ends.
SELECT token FROM lease_celery_leases
WHERE `key` = %(key)s AND state = 'running' AND owner = %(owner)s AND token = %(token)s
  AND expires_at > {clock}
FOR UPDATE

-- name: checkpoint
UPDATE lease_celery_leases SET checkpoint = %(checkpoint)s
WHERE `key` = %(key)s AND state = 'running' AND owner = %(owner)s AND token = %(token)s
  AND expires_at > {clock}

-- name: cancel_held
-- An operator's cancel reaches a live holder through its next renewal. Affected rows 0 when the
-- reason was already set: the caller then checks the row (cancel_done).
UPDATE lease_celery_leases SET cancel = %(reason)s
WHERE `key` = %(key)s AND state = 'running' AND expires_at > {clock}

-- name: cancel_idle
-- A key nobody holds (no row, ready, an expired lease, a purge tombstone) goes dead at once,
-- keeping its token. Done and dead keys are left alone.
INSERT INTO lease_celery_leases
       (`key`, state, owner, token, expires_at, attempts, takeovers, reason, updated_at, cancel,
        nonce)
VALUES (%(key)s, 'dead', NULL, 0, {now}, 0, 0, %(reason)s, {now}, %(reason)s, %(nonce)s)
ON DUPLICATE KEY UPDATE
    nonce      = IF(state IN ('ready', 'purged')
                    OR (state = 'running' AND expires_at <= {clock}), VALUES(nonce), nonce),
    owner      = IF(nonce <=> VALUES(nonce) AND state = 'purged', NULL, owner),
    attempts   = IF(nonce <=> VALUES(nonce) AND state = 'purged', 0, attempts),
    state      = IF(nonce <=> VALUES(nonce), 'dead', state),
    reason     = IF(nonce <=> VALUES(nonce), VALUES(reason), reason),
    expires_at = IF(nonce <=> VALUES(nonce), VALUES(expires_at), expires_at),
    updated_at = IF(nonce <=> VALUES(nonce), VALUES(updated_at), updated_at),
    not_before = IF(nonce <=> VALUES(nonce), NULL, not_before),
    settling   = IF(nonce <=> VALUES(nonce), 0, settling),
    sweep_at   = IF(nonce <=> VALUES(nonce), NULL, sweep_at),
    swept_by   = IF(nonce <=> VALUES(nonce), NULL, swept_by),
    cancel     = IF(nonce <=> VALUES(nonce), VALUES(cancel), cancel)

-- name: cancel_state
-- After a cancel: the row as it is now (did this call, or an earlier send of it, cancel it?).
SELECT state, cancel, nonce FROM lease_celery_leases WHERE `key` = %(key)s

-- name: get
SELECT `key`, state, owner, token, expires_at, attempts, result, updated_at, fence, takeovers,
       not_before, reason, task, settling, checkpoint, cancel
FROM lease_celery_leases WHERE `key` = %(key)s AND state <> 'purged'

-- name: is_current
SELECT 1 AS current FROM lease_celery_leases
WHERE `key` = %(key)s AND state = 'running' AND owner = %(owner)s AND token = %(token)s
  AND expires_at > {clock}
LOCK IN SHARE MODE

-- name: effect_insert
INSERT IGNORE INTO lease_celery_effects
       (`key`, fingerprint, state, lease_key, lease_token, lease_owner, started_at, attempts,
        result, version, updated_at)
VALUES (%(key)s, %(fingerprint)s, 'in_flight', %(lease_key)s, %(lease_token)s,
        %(lease_owner)s, {now}, 1, NULL, 1, {now})

-- name: effect_get
SELECT `key`, fingerprint, state, lease_key, lease_token, lease_owner, started_at, attempts,
       result, version, updated_at
FROM lease_celery_effects WHERE `key` = %(key)s

-- name: effect_find
-- One state, newest first: a range of the state index read backwards.
SELECT `key`, fingerprint, state, lease_key, lease_token, lease_owner, started_at, attempts,
       result, version, updated_at
FROM lease_celery_effects WHERE state = %(state)s
ORDER BY updated_at DESC LIMIT %(limit)s

-- name: effect_find_any
-- Every state, newest first: the updated_at index read backwards.
SELECT `key`, fingerprint, state, lease_key, lease_token, lease_owner, started_at, attempts,
       result, version, updated_at
FROM lease_celery_effects
ORDER BY updated_at DESC LIMIT %(limit)s

-- name: effect_update
UPDATE lease_celery_effects
SET state = %(state)s, result = %(result)s, version = version + 1, updated_at = {now}
WHERE `key` = %(key)s AND version = %(version)s

-- name: effect_restart
UPDATE lease_celery_effects
SET state = 'in_flight', lease_key = %(lease_key)s, lease_token = %(lease_token)s,
    lease_owner = %(lease_owner)s, started_at = {now}, attempts = attempts + 1,
    version = version + 1, updated_at = {now}
WHERE `key` = %(key)s AND version = %(version)s

-- name: effect_delete
DELETE FROM lease_celery_effects WHERE `key` = %(key)s AND version = %(version)s

-- name: limit_upsert
-- A limited claim records the limit and rate its task asks for.
INSERT INTO lease_celery_limits (grp, task_limit, task_rate, task_interval, updated_at)
VALUES (%(grp)s, %(limit)s, %(rate)s, %(interval)s, %(at)s)
ON DUPLICATE KEY UPDATE task_limit = VALUES(task_limit), task_rate = VALUES(task_rate),
    task_interval = VALUES(task_interval)

-- name: limit_lock
-- ... then locks the group's row: its claims are serialised, no others.
SELECT task_limit, set_limit, task_interval, set_interval, tat, slots, seq
FROM lease_celery_limits WHERE grp = %(grp)s FOR UPDATE

-- name: key_held
-- The key itself refuses a claim (claim's condition, negated), read locked.
SELECT 1 AS held FROM lease_celery_leases
WHERE `key` = %(key)s AND state <> 'purged'
  AND NOT ((state = 'ready' AND (not_before IS NULL OR not_before <= %(at)s))
           OR (state = 'running' AND expires_at <= %(at)s))
FOR UPDATE

-- name: group_running
SELECT count(*) AS n FROM lease_celery_leases
WHERE grp = %(grp)s AND state = 'running' AND expires_at > %(at)s AND `key` <> %(key)s

-- name: waiters_ahead
SELECT count(*) AS n FROM lease_celery_waiters
WHERE grp = %(grp)s
  AND seq < COALESCE((SELECT seq FROM (SELECT seq FROM lease_celery_waiters
                                       WHERE grp = %(grp)s AND `key` = %(key)s) AS mine),
                     9223372036854775807)

-- name: waiter_park
-- Over the limit: the key waits, once, in arrival order; a waiter handed on and refused again
-- keeps its place. Affected rows: 1 parked now.
INSERT INTO lease_celery_waiters (grp, `key`, seq, task, since)
VALUES (%(grp)s, %(key)s, %(seq)s, %(task)s, %(at)s)
ON DUPLICATE KEY UPDATE handed_at = NULL

-- name: group_seq_bump
UPDATE lease_celery_limits SET seq = seq + 1 WHERE grp = %(grp)s

-- name: waiter_count
SELECT count(*) AS n FROM lease_celery_waiters WHERE grp = %(grp)s

-- name: waiter_drop
DELETE FROM lease_celery_waiters WHERE grp = %(grp)s AND `key` = %(key)s

-- name: group_granted
UPDATE lease_celery_limits
SET slots = slots + 1, updated_at = %(at)s,
    tat = IF(%(interval)s IS NULL, tat, GREATEST(COALESCE(tat, %(at)s), %(at)s) + %(interval)s)
WHERE grp = %(grp)s

-- name: groups_waiting
SELECT DISTINCT grp FROM lease_celery_waiters ORDER BY grp LIMIT %(limit)s

-- name: group_limit
SELECT task_limit, set_limit FROM lease_celery_limits WHERE grp = %(grp)s FOR UPDATE

-- name: waiters_first
SELECT grp, `key`, task, since, handed_at FROM lease_celery_waiters
WHERE grp = %(grp)s ORDER BY seq LIMIT %(limit)s

-- name: waiter_handed
UPDATE lease_celery_waiters SET handed_at = %(at)s WHERE grp = %(grp)s AND `key` = %(key)s

-- name: limit_set
INSERT INTO lease_celery_limits (grp, set_limit, set_rate, set_interval, updated_at)
VALUES (%(grp)s, %(set_limit)s, %(set_rate)s, %(set_interval)s, {now})
ON DUPLICATE KEY UPDATE
    set_limit    = IF(%(change_limit)s, VALUES(set_limit), set_limit),
    set_rate     = IF(%(change_rate)s, VALUES(set_rate), set_rate),
    set_interval = IF(%(change_rate)s, VALUES(set_interval), set_interval),
    tat          = IF(%(change_rate)s, NULL, tat),
    updated_at   = VALUES(updated_at)

-- name: limits_list
SELECT l.grp, l.task_limit, l.task_rate, l.set_limit, l.set_rate, l.updated_at,
       (SELECT count(*) FROM lease_celery_leases r
        WHERE r.grp = l.grp AND r.state = 'running' AND r.expires_at > {clock}) AS running,
       (SELECT count(*) FROM lease_celery_waiters w WHERE w.grp = l.grp) AS waiting
FROM lease_celery_limits l
WHERE %(grp)s IS NULL OR l.grp = %(grp)s
ORDER BY l.grp LIMIT %(limit)s
