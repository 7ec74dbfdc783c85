-- 0005: volunteers' identities (docs/design.md, "Trust"; issue 32). A worker's identity is the
-- fingerprint of the key it proved it holds (proto.Fingerprint, 'id:' and hex); a worker id
-- never contains ':', so the two never collide. Credit is kept per account: the identity, or the
-- worker id of a worker without one. Nothing personal is kept: a fingerprint names a key, not a
-- person.

ALTER TABLE work ADD COLUMN identity TEXT NOT NULL DEFAULT '';

-- credits is keyed by account from here on; worker_id is the worker whose work under the
-- account was recorded last (the one a contributor's page knows).
DROP TRIGGER work_insert_credits;
DROP TRIGGER work_update_credits;
DROP TRIGGER work_delete_credits;
DROP TRIGGER work_key_is_final;
ALTER TABLE credits RENAME COLUMN worker_id TO account;
ALTER TABLE credits ADD COLUMN worker_id TEXT NOT NULL DEFAULT '';
UPDATE credits SET worker_id = account;
CREATE INDEX credits_worker ON credits (job_id, worker_id);
CREATE INDEX credits_account ON credits (account);

CREATE TRIGGER work_insert_credits AFTER INSERT ON work
BEGIN
    INSERT INTO credits (job_id, account) VALUES (NEW.job_id, iif(NEW.identity <> '', NEW.identity, NEW.worker_id))
        ON CONFLICT (job_id, account) DO NOTHING;
    UPDATE credits SET
        worker_id      = NEW.worker_id,
        verified_rows  = verified_rows + (NEW.state = 'verified'),
        verified_mb    = verified_mb + iif(NEW.state = 'verified', NEW.micro_batches, 0),
        verified_flops = verified_flops + iif(NEW.state = 'verified', NEW.flops, 0.0),
        pending_rows   = pending_rows + (NEW.state = 'pending'),
        pending_mb     = pending_mb + iif(NEW.state = 'pending', NEW.micro_batches, 0),
        pending_flops  = pending_flops + iif(NEW.state = 'pending', NEW.flops, 0.0),
        rejected_rows  = rejected_rows + (NEW.state = 'rejected'),
        rejected_mb    = rejected_mb + iif(NEW.state = 'rejected', NEW.micro_batches, 0)
    WHERE job_id = NEW.job_id AND account = iif(NEW.identity <> '', NEW.identity, NEW.worker_id);
END;

-- The key columns and the identity never change, so OLD and NEW name the same credits row.
CREATE TRIGGER work_update_credits AFTER UPDATE OF state, micro_batches, flops ON work
BEGIN
    UPDATE credits SET
        verified_rows  = verified_rows - (OLD.state = 'verified') + (NEW.state = 'verified'),
        verified_mb    = verified_mb - iif(OLD.state = 'verified', OLD.micro_batches, 0)
                                     + iif(NEW.state = 'verified', NEW.micro_batches, 0),
        verified_flops = iif(verified_rows - (OLD.state = 'verified') + (NEW.state = 'verified') = 0, 0.0,
                             verified_flops - iif(OLD.state = 'verified', OLD.flops, 0.0)
                                            + iif(NEW.state = 'verified', NEW.flops, 0.0)),
        pending_rows   = pending_rows - (OLD.state = 'pending') + (NEW.state = 'pending'),
        pending_mb     = pending_mb - iif(OLD.state = 'pending', OLD.micro_batches, 0)
                                    + iif(NEW.state = 'pending', NEW.micro_batches, 0),
        pending_flops  = iif(pending_rows - (OLD.state = 'pending') + (NEW.state = 'pending') = 0, 0.0,
                             pending_flops - iif(OLD.state = 'pending', OLD.flops, 0.0)
                                           + iif(NEW.state = 'pending', NEW.flops, 0.0)),
        rejected_rows  = rejected_rows - (OLD.state = 'rejected') + (NEW.state = 'rejected'),
        rejected_mb    = rejected_mb - iif(OLD.state = 'rejected', OLD.micro_batches, 0)
                                     + iif(NEW.state = 'rejected', NEW.micro_batches, 0)
    WHERE job_id = NEW.job_id AND account = iif(NEW.identity <> '', NEW.identity, NEW.worker_id);
END;

CREATE TRIGGER work_key_is_final
BEFORE UPDATE OF job_id, worker_id, step, plan_version, identity ON work
BEGIN
    SELECT RAISE(ABORT, 'a work row''s key cannot change');
END;

CREATE TRIGGER work_delete_credits AFTER DELETE ON work
BEGIN
    UPDATE credits SET
        verified_rows  = verified_rows - (OLD.state = 'verified'),
        verified_mb    = verified_mb - iif(OLD.state = 'verified', OLD.micro_batches, 0),
        verified_flops = iif(verified_rows - (OLD.state = 'verified') = 0, 0.0,
                             verified_flops - iif(OLD.state = 'verified', OLD.flops, 0.0)),
        pending_rows   = pending_rows - (OLD.state = 'pending'),
        pending_mb     = pending_mb - iif(OLD.state = 'pending', OLD.micro_batches, 0),
        pending_flops  = iif(pending_rows - (OLD.state = 'pending') = 0, 0.0,
                             pending_flops - iif(OLD.state = 'pending', OLD.flops, 0.0)),
        rejected_rows  = rejected_rows - (OLD.state = 'rejected'),
        rejected_mb    = rejected_mb - iif(OLD.state = 'rejected', OLD.micro_batches, 0)
    WHERE job_id = OLD.job_id AND account = iif(OLD.identity <> '', OLD.identity, OLD.worker_id);
END;

-- A ban covers the banned worker's identity in the job ('' when it had none), and for a while
-- (shoal serve --ban-address-for) its address: an IPv4 address, or an IPv6 /64 ('' when not
-- known). The address is kept only with a ban.
ALTER TABLE bans ADD COLUMN identity TEXT NOT NULL DEFAULT '';
ALTER TABLE bans ADD COLUMN addr TEXT NOT NULL DEFAULT '';
CREATE INDEX bans_identity ON bans (job_id, identity) WHERE identity <> '';
CREATE INDEX bans_addr ON bans (at, addr) WHERE addr <> '';

-- Whether the worker ever took part in a step (it has work rows): rows of workers that never did
-- — a join wave's, a sybil flood's — expire (PruneWorkers).
ALTER TABLE workers ADD COLUMN took_part INTEGER NOT NULL DEFAULT 1 CHECK (took_part IN (0, 1));
CREATE INDEX workers_unused ON workers (last_seen_at) WHERE took_part = 0 AND state = 'gone';
CREATE INDEX sessions_issued ON sessions (issued_at);
