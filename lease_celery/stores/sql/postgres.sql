-- PostgreSQL dialect (psycopg, %(name)s parameters). {schema} is replaced by the quoted schema
-- name. Every decision reads the server clock inside the statement (clock_timestamp()), unless
-- the store was opened with an injected clock, which is passed as %(now)s; the worker's own
-- clock is never used. Times are epoch seconds (double precision), as everywhere in the library.

-- name: lock_schema
SELECT pg_advisory_xact_lock(hashtext('lease_celery.schema'))

-- name: create_schema
CREATE SCHEMA IF NOT EXISTS {schema}

-- name: create_leases
CREATE TABLE IF NOT EXISTS {schema}.lease_celery_leases (
    key         text             PRIMARY KEY,
    state       text             NOT NULL CHECK (state IN ('ready', 'running', 'done', 'dead')),
    owner       text,
    token       bigint           NOT NULL CHECK (token >= 0),
    expires_at  double precision,
    attempts    integer          NOT NULL DEFAULT 0,
    result      jsonb,
    updated_at  double precision NOT NULL,
    fence       bigint           NOT NULL DEFAULT 0
)

-- name: create_fence
-- The store-wide fence: a sequence, drawn by every claim (gaps are harmless, order is not lost).
CREATE SEQUENCE IF NOT EXISTS {schema}.lease_celery_fence

-- name: create_retired
-- The last token of every purged key: a re-created key continues from it, never from 1.
CREATE TABLE IF NOT EXISTS {schema}.lease_celery_retired (
    key    text   PRIMARY KEY,
    token  bigint NOT NULL
)

-- name: create_effects
-- Effect receipts (lease_celery.effects): one row per business key. Every change bumps
-- version, and every change is conditional on the version the caller read.
CREATE TABLE IF NOT EXISTS {schema}.lease_celery_effects (
    key          text             PRIMARY KEY,
    fingerprint  text             NOT NULL,
    state        text             NOT NULL
                 CHECK (state IN ('in_flight', 'done', 'needs_reconciliation')),
    lease_key    text,
    lease_token  bigint,
    lease_owner  text,
    started_at   double precision NOT NULL,
    attempts     integer          NOT NULL,
    result       jsonb,
    version      bigint           NOT NULL,
    updated_at   double precision NOT NULL
)

-- name: create_meta
CREATE TABLE IF NOT EXISTS {schema}.lease_celery_meta (
    name  text PRIMARY KEY,
    value text NOT NULL
)

-- name: get_schema_version
SELECT value FROM {schema}.lease_celery_meta WHERE name = 'schema_version'

-- name: set_schema_version
INSERT INTO {schema}.lease_celery_meta (name, value) VALUES ('schema_version', %(version)s)
ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value

-- name: now
SELECT COALESCE(%(now)s::double precision,
                extract(epoch FROM clock_timestamp())::double precision)

-- name: claim
-- One statement: a new key starts at token 1 (or after its retired token); a conflicting row is locked and re-checked in its
-- latest version, and taken only when ready or expired (expires_at <= now).
WITH clock AS (
    SELECT COALESCE(%(now)s::double precision,
                    extract(epoch FROM clock_timestamp())::double precision) AS now
)
INSERT INTO {schema}.lease_celery_leases AS l
       (key, state, owner, token, expires_at, attempts, result, updated_at, fence)
SELECT %(key)s, 'running', %(owner)s,
       COALESCE((SELECT r.token FROM {schema}.lease_celery_retired AS r WHERE r.key = %(key)s),
                0) + 1,
       clock.now + %(ttl)s, 1, NULL, clock.now, nextval('{schema}.lease_celery_fence')
FROM clock
ON CONFLICT (key) DO UPDATE SET
    state      = 'running',
    owner      = EXCLUDED.owner,
    token      = l.token + 1,
    expires_at = EXCLUDED.expires_at,
    attempts   = l.attempts + 1,
    result     = NULL,
    updated_at = EXCLUDED.updated_at,
    fence      = EXCLUDED.fence
WHERE l.state = 'ready' OR (l.state = 'running' AND l.expires_at <= EXCLUDED.updated_at)
RETURNING token, expires_at, fence

-- name: renew_many
-- Each (key, owner, token) is renewed only while running, its own, and not expired.
WITH clock AS (
    SELECT COALESCE(%(now)s::double precision,
                    extract(epoch FROM clock_timestamp())::double precision) AS now
)
UPDATE {schema}.lease_celery_leases AS l
SET expires_at = clock.now + %(ttl)s, updated_at = clock.now
FROM clock, unnest(%(keys)s::text[], %(owners)s::text[], %(tokens)s::bigint[])
     AS c(key, owner, token)
WHERE l.key = c.key AND l.state = 'running' AND l.owner = c.owner AND l.token = c.token
  AND l.expires_at > clock.now
RETURNING l.key, l.expires_at

-- name: finish
WITH clock AS (
    SELECT COALESCE(%(now)s::double precision,
                    extract(epoch FROM clock_timestamp())::double precision) AS now
)
UPDATE {schema}.lease_celery_leases AS l
SET state = 'done', result = %(result)s::jsonb, expires_at = clock.now, updated_at = clock.now
FROM clock
WHERE l.key = %(key)s AND l.state = 'running' AND l.owner = %(owner)s AND l.token = %(token)s
  AND l.expires_at > clock.now
RETURNING l.token

-- name: release
WITH clock AS (
    SELECT COALESCE(%(now)s::double precision,
                    extract(epoch FROM clock_timestamp())::double precision) AS now
)
UPDATE {schema}.lease_celery_leases AS l
SET state = 'ready', expires_at = clock.now, updated_at = clock.now
FROM clock
WHERE l.key = %(key)s AND l.state = 'running' AND l.owner = %(owner)s AND l.token = %(token)s
  AND l.expires_at > clock.now
RETURNING l.token

-- name: lock_current
-- The fencing predicate under a row lock, for store.fenced(): no claim can take the row over
-- until the caller's transaction ends.
SELECT l.token
FROM {schema}.lease_celery_leases AS l
WHERE l.key = %(key)s AND l.state = 'running' AND l.owner = %(owner)s AND l.token = %(token)s
  AND l.expires_at > COALESCE(%(now)s::double precision,
                              extract(epoch FROM clock_timestamp())::double precision)
FOR UPDATE

-- name: get
SELECT key, state, owner, token, expires_at, attempts, result, updated_at, fence
FROM {schema}.lease_celery_leases WHERE key = %(key)s

-- name: purge
-- Delete the row unless a live lease holds it, and retire its token in the same statement.
WITH clock AS (
    SELECT COALESCE(%(now)s::double precision,
                    extract(epoch FROM clock_timestamp())::double precision) AS now
), gone AS (
    DELETE FROM {schema}.lease_celery_leases AS l
    USING clock
    WHERE l.key = %(key)s AND (l.state <> 'running' OR l.expires_at <= clock.now)
    RETURNING l.key, l.token
)
INSERT INTO {schema}.lease_celery_retired AS r (key, token)
SELECT key, token FROM gone
ON CONFLICT (key) DO UPDATE SET token = GREATEST(r.token, EXCLUDED.token)
RETURNING r.token

-- name: effect_insert
INSERT INTO {schema}.lease_celery_effects
       (key, fingerprint, state, lease_key, lease_token, lease_owner, started_at, attempts,
        result, version, updated_at)
SELECT %(key)s, %(fingerprint)s, 'in_flight', %(lease_key)s, %(lease_token)s, %(lease_owner)s,
       clock.now, 1, NULL, 1, clock.now
FROM (SELECT COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision) AS now) AS clock
ON CONFLICT (key) DO NOTHING
RETURNING key

-- name: effect_get
SELECT key, fingerprint, state, lease_key, lease_token, lease_owner, started_at, attempts,
       result, version, updated_at
FROM {schema}.lease_celery_effects WHERE key = %(key)s

-- name: effect_update
UPDATE {schema}.lease_celery_effects
SET state = %(state)s, result = %(result)s::jsonb, version = version + 1,
    updated_at = COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision)
WHERE key = %(key)s AND version = %(version)s
RETURNING key

-- name: effect_restart
UPDATE {schema}.lease_celery_effects AS e
SET state = 'in_flight', lease_key = %(lease_key)s, lease_token = %(lease_token)s,
    lease_owner = %(lease_owner)s, started_at = clock.now, attempts = e.attempts + 1,
    version = e.version + 1, updated_at = clock.now
FROM (SELECT COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision) AS now) AS clock
WHERE e.key = %(key)s AND e.version = %(version)s
RETURNING e.key

-- name: effect_delete
DELETE FROM {schema}.lease_celery_effects WHERE key = %(key)s AND version = %(version)s
RETURNING key
