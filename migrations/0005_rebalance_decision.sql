-- The rebalancer's decisions: one row per round that changed shares,
-- written in the same transaction as the shares. `changes` is a JSON array
-- of {"tenant", "route", "shares": {region: share}, "demand_per_second":
-- {region: rate}}; tenant and route are null for the global scope. Only
-- the latest 100 rows are kept.
CREATE TABLE rebalance_decision (
    id          bigserial   PRIMARY KEY,
    decided_at  timestamptz NOT NULL DEFAULT now(),
    instance_id text        NOT NULL,
    changes     jsonb       NOT NULL
);
