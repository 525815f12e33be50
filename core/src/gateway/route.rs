//! Route: the ordered candidate targets for a request's model.
//!
//! Runs after inspection. Takes the config snapshot, the backends' [`HealthTable`], the
//! requested model, the caller's key (index and entity: a key's own routes, then its entity's,
//! come before the global ones) and the worker's random state; returns [`Candidates`]: the
//! targets to try,
//! in order, of which the first (the primary) is already chosen. A route is a list of target
//! groups in fallback order; within a group the group's [`Strategy`] picks a (target, backend)
//! pair among the backends available now (breaker closed or half-open without a probe out, not
//! cooling down) that pass the capability filter (the target's context window holds the prompt
//! estimate plus the requested output; the backend is loaded under 95% — dropped when no
//! backend is). What follows the primary, for fallback: the
//! cluster's other backends, the group's other targets, then the next groups, each walked the
//! same way; a backend that is out is skipped. Each [`Target`] carries the model name the
//! upstream will see (the target's `model`, else the cluster's `model_map` entry). Routes are
//! stored most specific first (exact names, then globs by literal length), so the first match
//! is the most specific.
//!
//! Raises 404 `model_not_found` when no route matches, 400 `context_length_exceeded` when no
//! target's context window holds the request, and 503 `upstream_unavailable` with
//! `Retry-After` (when the first backend comes back) when every backend of the route is out.

use std::cell::Cell;

use crate::config::limits::KeyIdx;
use crate::config::routing::Strategy;
use crate::config::sticky::StickyRule;
use crate::config::{
    Backend, Cluster, ClusterId, Credential, Route, RouteTarget, Snapshot, TargetGroup,
};
use crate::gateway::error::GatewayError;
use crate::gateway::sticky::Session;
use crate::upstream::health::{Availability, BackendHealth, HealthTable, LoadSignals};

/// Where one attempt of a request goes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Target<'s> {
    pub(crate) cluster_id: ClusterId,
    pub(crate) cluster: &'s Cluster,
    pub(crate) backend: &'s Backend,
    /// The model name to put in the forwarded body, when it differs from the requested one.
    pub(crate) mapped_model: Option<&'s str>,
    /// The backend's shared health (`None`: untracked).
    pub(crate) health: Option<&'s BackendHealth>,
    /// The cluster credential this attempt carries, and its place in the cluster's pool.
    pub(crate) credential: Option<(usize, &'s Credential)>,
    /// How long the attempt waits for the response head (its group's `first_byte_timeout_ms`).
    pub(crate) first_byte_timeout: std::time::Duration,
    /// With `[saturation]`: the most requests the process may have in flight to the backend
    /// (the target's `max_in_flight`), claimed when the attempt begins.
    pub(crate) cap: Option<u32>,
}

impl<'s> Target<'s> {
    /// The provider's limits an attempt on this target counts against: its cluster's and its
    /// credential's (`provider_limits`), each if configured.
    pub(crate) fn provider_limits(&self) -> [Option<&'s crate::config::limits::ProviderLimits>; 2] {
        [
            self.cluster.provider_limits.as_ref(),
            self.credential
                .and_then(|(_, c)| c.provider_limits.as_ref()),
        ]
    }

    /// The same backend with another credential of its cluster's pool, not benched at `now`.
    pub(crate) fn with_other_credential(
        &self,
        health: &HealthTable,
        rng: &Cell<u64>,
        now: u64,
    ) -> Option<Target<'s>> {
        let (current, _) = self.credential?;
        let index = pick_credential(
            self.cluster_id,
            self.cluster,
            health,
            rng,
            now,
            Some(current),
        )
        .filter(|&i| !health.credential_benched(self.cluster_id, i, now))?;
        Some(Target {
            credential: Some((index, &self.cluster.credentials[index])),
            ..*self
        })
    }
}

/// A credential of the cluster's pool by weight among those not benched (`except` left out);
/// when every one is benched, the first (`None`: no credential, or only `except`).
fn pick_credential(
    cluster_id: ClusterId,
    cluster: &Cluster,
    health: &HealthTable,
    rng: &Cell<u64>,
    now: u64,
    except: Option<usize>,
) -> Option<usize> {
    let pool = &cluster.credentials;
    let usable = |i: &usize| Some(*i) != except && !health.credential_benched(cluster_id, *i, now);
    let usable = (0..pool.len())
        .filter(usable)
        .map(|i| (i, u64::from(pool[i].weight)));
    // All benched: the request still goes out (the bench may be stale), but never with the
    // credential that just failed.
    weighted_pick(usable, rng).or_else(|| (0..pool.len()).find(|&i| Some(i) != except))
}

/// A request's targets in the order to try them: [`Candidates::primary`] first, then what
/// [`Candidates::next_fallback`] yields. Borrowed from the snapshot; allocates nothing.
#[derive(Debug, Clone)]
pub(crate) struct Candidates<'s> {
    snapshot: &'s Snapshot,
    health: &'s HealthTable,
    route: &'s Route,
    /// The route's place in `snapshot.routes` (its wait queue's, with `[saturation]`).
    pub(crate) route_index: usize,
    rng: &'s Cell<u64>,
    /// When availability is judged ([`mono_ms`](crate::sys::time::mono_ms)).
    now: u64,
    /// What the request needs of a target's context window (0: nothing known).
    needed_tokens: u64,
    primary: Target<'s>,
    /// The route's sticky rule and what the request said of its session.
    pub(crate) sticky: Option<(&'s StickyRule, Session)>,
    /// The group the walk started in (the primary's: a pinned session's may be a later one),
    /// how many groups on it is now (wrapping round to the earlier ones), and where in it.
    start_group: usize,
    group_step: usize,
    walk: Option<Walk>,
    /// The (backend, model) pairs already yielded, the primary first: a pair listed in two
    /// groups is tried once, and the same backend with another model is a fallback of its own.
    tried: [(usize, Option<&'s str>); MAX_TRIED],
    tried_len: usize,
}

/// More than `routing.max_attempts` (at most 10) can use.
const MAX_TRIED: usize = 12;

/// A walk through one group: the targets in rotation from the picked one, and in each target
/// the cluster's backends in rotation from one picked by weight.
#[derive(Debug, Clone, Copy)]
struct Walk {
    first_target: usize,
    target_step: usize,
    first_backend: usize,
    backend_step: usize,
}

impl<'s> Candidates<'s> {
    /// The first target to try.
    pub(crate) fn primary(&self) -> Target<'s> {
        self.primary
    }

    /// The route's model pattern, as written.
    pub(crate) fn route_pattern(&self) -> &'s str {
        self.route.pattern.source()
    }

    /// The next fallback after the primary (and the fallbacks already yielded), for a request
    /// for `model` whose last attempt failed for `cause` (a `fallback_reason` label; `None`:
    /// it was not sent, so any group may take it); `None` when every target was walked. A
    /// group whose `when` does not name the cause is passed over, for good.
    pub(crate) fn next_fallback(&mut self, model: &str, cause: Option<&str>) -> Option<Target<'s>> {
        // Availability as of now: an attempt before this one may have taken a while.
        self.now = crate::sys::time::mono_ms();
        let groups = self.route.groups.len();
        loop {
            if self.group_step >= groups || self.tried_len >= MAX_TRIED {
                return None;
            }
            let group = &self.route.groups[(self.start_group + self.group_step) % groups];
            let Some(walk) = self.walk.as_mut() else {
                let refused = match (group.when, cause) {
                    (Some(when), Some(cause)) => !when.contains(cause),
                    _ => false,
                };
                if refused {
                    self.group_step += 1;
                    continue;
                }
                let picker = Picker {
                    snapshot: self.snapshot,
                    health: self.health,
                    rng: self.rng,
                    now: self.now,
                    needed_tokens: self.needed_tokens,
                    model,
                };
                self.walk = picker.start_walk(group);
                if self.walk.is_none() {
                    self.group_step += 1;
                }
                continue;
            };
            let Some((t, b)) = walk.advance(self.snapshot, self.health, group, self.rng, self.now)
            else {
                self.walk = None;
                self.group_step += 1;
                continue;
            };
            let target = self.target(group, t, b, model);
            let pair = (target.backend.id, target.mapped_model);
            if self.tried[..self.tried_len].contains(&pair) {
                continue;
            }
            let fits = group.targets[t]
                .context_window
                .is_none_or(|w| w >= self.needed_tokens);
            let roomy = || {
                self.snapshot.saturation.is_none()
                    || !full(&group.targets[t], target.health, self.now, self.snapshot)
            };
            if fits && target.health.is_none_or(|h| available(h, self.now)) && roomy() {
                self.tried[self.tried_len] = pair;
                self.tried_len += 1;
                return Some(target);
            }
        }
    }

    fn target(&self, group: &'s TargetGroup, t: usize, b: usize, model: &str) -> Target<'s> {
        make_target(
            self.snapshot,
            self.health,
            group,
            t,
            b,
            model,
            self.rng,
            self.now,
        )
    }
}

#[allow(clippy::too_many_arguments)] // the walk's position and what a target is made of
fn make_target<'s>(
    snapshot: &'s Snapshot,
    health: &'s HealthTable,
    group: &'s TargetGroup,
    t: usize,
    b: usize,
    model: &str,
    rng: &Cell<u64>,
    now: u64,
) -> Target<'s> {
    let route_target = &group.targets[t];
    let cluster = &snapshot.clusters[route_target.cluster];
    let backend = &cluster.backends[b];
    let mapped_model = match &route_target.model {
        Some(m) => Some(m.as_str()),
        None => cluster.model_map.get(model).map(String::as_str),
    }
    .filter(|m| *m != model);
    let credential = pick_credential(route_target.cluster, cluster, health, rng, now, None)
        .map(|i| (i, &cluster.credentials[i]));
    Target {
        cluster_id: route_target.cluster,
        cluster,
        backend,
        mapped_model,
        health: health.get(backend.id),
        credential,
        first_byte_timeout: group.first_byte_timeout,
        cap: route_target
            .max_in_flight
            .filter(|_| snapshot.saturation.is_some()),
    }
}

impl Walk {
    /// The next (target, backend) position of the walk, whether available or not.
    fn advance(
        &mut self,
        snapshot: &Snapshot,
        health: &HealthTable,
        group: &TargetGroup,
        rng: &Cell<u64>,
        now: u64,
    ) -> Option<(usize, usize)> {
        let targets = group.targets.len();
        loop {
            if self.target_step >= targets {
                return None;
            }
            let t = (self.first_target + self.target_step) % targets;
            let cluster = &snapshot.clusters[group.targets[t].cluster];
            let backends = cluster.backends.len();
            if self.backend_step < backends {
                let b = (self.first_backend + self.backend_step) % backends;
                self.backend_step += 1;
                return Some((t, b));
            }
            self.target_step += 1;
            self.backend_step = 0;
            if self.target_step < targets {
                let next = (self.first_target + self.target_step) % targets;
                let cluster = &snapshot.clusters[group.targets[next].cluster];
                self.first_backend = choose_backend(cluster, health, rng, now).unwrap_or(0);
            }
        }
    }
}

/// With `[saturation]`: the backend has no room for one more of the target's requests — its
/// requests in flight from this process at the target's `max_in_flight`, or its scraped
/// waiting queue (fresh) at the target's `max_waiting`.
fn full(
    target: &RouteTarget,
    health: Option<&BackendHealth>,
    now: u64,
    snapshot: &Snapshot,
) -> bool {
    let Some(h) = health else {
        return false;
    };
    let at_cap = target
        .max_in_flight
        .is_some_and(|cap| h.load.in_flight() >= cap);
    let queued = || {
        target.max_waiting.is_some_and(|max| {
            h.load
                .queue(now, snapshot.routing.queue_stale_ms)
                .is_some_and(|(waiting, _, _)| waiting >= max)
        })
    };
    at_cap || queued()
}

fn available(health: &BackendHealth, now: u64) -> bool {
    !matches!(health.availability(now), Availability::Out { .. })
}

fn backend_available(health: &HealthTable, backend: &Backend, now: u64) -> bool {
    health.get(backend.id).is_none_or(|h| available(h, now))
}

/// What a group's strategy needs to pick: the backends' health and load, the time, the
/// request's size (for the capability filter) and its model (for the price table).
struct Picker<'s, 'm> {
    snapshot: &'s Snapshot,
    health: &'s HealthTable,
    rng: &'s Cell<u64>,
    now: u64,
    needed_tokens: u64,
    model: &'m str,
}

/// One (target, backend) pair a strategy may pick, with what it is judged on.
#[derive(Clone, Copy)]
struct Choice<'s> {
    t: usize,
    b: usize,
    weight: u64,
    target: &'s RouteTarget,
    health: Option<&'s BackendHealth>,
}

impl<'s> Picker<'s, '_> {
    /// Pick a group's (target, backend) pair by its strategy: the walk's start; `None` when no
    /// backend of the group can take the request.
    fn start_walk(&self, group: &'s TargetGroup) -> Option<Walk> {
        let stale = self.snapshot.routing.queue_stale_ms;
        // The capability filter: fits, and under 95% loaded — unless none is.
        let fits = |o: &Choice<'_>| {
            o.target
                .context_window
                .is_none_or(|w| w >= self.needed_tokens)
        };
        let roomy = |o: &Choice<'_>| self.load(o, stale) < 0.95;
        // A group with no context windows, no `max_in_flight` and no scraped queues has nothing
        // for the filter to look at: every available pair passes, so it is not asked.
        let filtered = group.targets.iter().any(|t| {
            t.context_window.is_some()
                || t.max_in_flight.is_some()
                || self.snapshot.clusters[t.cluster].queue_metrics
        });
        // With `[saturation]` a full backend is no choice at all: the request waits instead.
        let picked = if self.snapshot.saturation.is_some() {
            let room = |o: &Choice<'_>| !full(o.target, o.health, self.now, self.snapshot);
            self.pick(group, &|o| fits(o) && roomy(o) && room(o))
                .or_else(|| self.pick(group, &|o| fits(o) && room(o)))?
        } else if filtered {
            self.pick(group, &|o| fits(o) && roomy(o))
                .or_else(|| self.pick(group, &fits))?
        } else {
            self.pick(group, &|_| true)?
        };
        let (t, b) = picked;
        Some(Walk {
            first_target: t,
            target_step: 0,
            first_backend: b,
            backend_step: 0,
        })
    }

    /// Where `route` has the backend `identity` names, if it is available, fits the request
    /// and is under 95% loaded: the group and a walk starting at it.
    fn find_pinned(&self, route: &'s Route, identity: u64) -> Option<(usize, Walk)> {
        let stale = self.snapshot.routing.queue_stale_ms;
        route.groups.iter().enumerate().find_map(|(g, group)| {
            let found = self
                .options(group, &|o| {
                    o.target
                        .context_window
                        .is_none_or(|w| w >= self.needed_tokens)
                        && self.load(o, stale) < 0.95
                })
                .find(|o| {
                    let cluster = &self.snapshot.clusters[o.target.cluster];
                    self.health.identity(cluster.backends[o.b].id) == identity
                })?;
            Some((
                g,
                Walk {
                    first_target: found.t,
                    target_step: 0,
                    first_backend: found.b,
                    backend_step: 0,
                },
            ))
        })
    }

    /// Prefix affinity: of the first group with a backend that can take the request (available,
    /// fits, under 95% loaded), the one rendezvous hashing gives `prefix` — unless it has more
    /// in flight than bounded load allows ([`under_load_cap`]); then the group's strategy among
    /// those that it allows. `None`: no group has such a backend (the plain walk decides).
    fn find_prefix(
        &self,
        route: &'s Route,
        prefix: u64,
        load_factor: f64,
    ) -> Option<(usize, Walk)> {
        let stale = self.snapshot.routing.queue_stale_ms;
        let keep = |o: &Choice<'_>| {
            o.target
                .context_window
                .is_none_or(|w| w >= self.needed_tokens)
                && self.load(o, stale) < 0.95
        };
        let in_flight = |o: &Choice<'_>| o.health.map_or(0, |h| u64::from(h.load.in_flight()));
        route.groups.iter().enumerate().find_map(|(g, group)| {
            let options = self.options(group, &keep);
            let (total, weights) = options
                .clone()
                .fold((0, 0), |(n, w), o| (n + in_flight(&o), w + o.weight));
            let allowed = |o: &Choice<'_>| {
                under_load_cap(in_flight(o), o.weight, total, weights, load_factor)
            };
            let score = |o: &Choice<'_>| {
                let cluster = &self.snapshot.clusters[o.target.cluster];
                let identity = self.health.identity(cluster.backends[o.b].id);
                rendezvous_score(prefix, identity, o.weight)
            };
            let best = options.min_by(|a, b| score(a).total_cmp(&score(b)))?;
            let (t, b) = if allowed(&best) {
                (best.t, best.b)
            } else {
                self.pick(group, &|o| keep(o) && allowed(o))?
            };
            Some((
                g,
                Walk {
                    first_target: t,
                    target_step: 0,
                    first_backend: b,
                    backend_step: 0,
                },
            ))
        })
    }

    fn load(&self, o: &Choice<'_>, stale: u64) -> f64 {
        o.health.map_or(0.0, |h| {
            h.load.load(self.now, stale, o.target.max_in_flight)
        })
    }

    /// The group's available pairs that pass `keep`, in config order.
    fn options<'a>(
        &'a self,
        group: &'s TargetGroup,
        keep: &'a dyn Fn(&Choice<'s>) -> bool,
    ) -> impl Iterator<Item = Choice<'s>> + Clone + 'a {
        group
            .targets
            .iter()
            .enumerate()
            .flat_map(move |(t, target)| {
                let cluster = &self.snapshot.clusters[target.cluster];
                cluster
                    .backends
                    .iter()
                    .enumerate()
                    .filter_map(move |(b, backend)| {
                        let health = self.health.get(backend.id);
                        if !health.is_none_or(|h| available(h, self.now)) {
                            return None;
                        }
                        let o = Choice {
                            t,
                            b,
                            weight: u64::from(target.weight) * u64::from(backend.weight),
                            target,
                            health,
                        };
                        keep(&o).then_some(o)
                    })
            })
    }

    fn pick(
        &self,
        group: &'s TargetGroup,
        keep: &dyn Fn(&Choice<'s>) -> bool,
    ) -> Option<(usize, usize)> {
        if group.strategy == Strategy::Weighted {
            return self.weighted_loop(group, keep);
        }
        let options = self.options(group, keep);
        let stale = self.snapshot.routing.queue_stale_ms;
        fn signals<'h>(o: &Choice<'h>) -> Option<&'h LoadSignals> {
            o.health.map(|h| &h.load)
        }
        let chosen = match group.strategy {
            Strategy::Weighted => self.weighted(options),
            Strategy::LeastInFlight => self.two_choices(options, |o| {
                signals(o).map_or(0.0, |l| f64::from(l.in_flight()))
            }),
            Strategy::PeakEwma => self.two_choices(options, |o| {
                signals(o).map_or(0.0, |l| {
                    l.latency_us(self.now).unwrap_or(0.0) * f64::from(l.in_flight() + 1)
                })
            }),
            Strategy::QueueAware => self.two_choices(options, |o| {
                signals(o).map_or(0.0, |l| l.queue_depth(self.now, stale) as f64)
            }),
            Strategy::LowestTtft => self.lowest(options, |o| {
                signals(o).and_then(|l| l.ttft_us(self.now)).unwrap_or(0.0)
            }),
            Strategy::LatencyFirst => self.lowest(options, |o| {
                let latency = signals(o)
                    .and_then(|l| l.latency_us(self.now))
                    .unwrap_or(0.0);
                latency / (1.0 - self.load(o, stale).min(0.99))
            }),
            Strategy::QualityFirst => {
                self.lowest(options, |o| -(o.target.context_window.unwrap_or(0) as f64))
            }
            Strategy::CostFirst => {
                // The cheapest unless loaded ≥ 90%: then the next cheapest.
                let price = |o: &Choice<'_>| self.price(o.target);
                let unloaded = |o: &Choice<'_>| self.load(o, stale) < 0.9;
                let cheap = self.lowest(options.clone().filter(unloaded), price);
                cheap.or_else(|| self.lowest(options, price))
            }
        }?;
        Some((chosen.t, chosen.b))
    }

    /// The default strategy, the one most requests take: weighted random choice among the
    /// group's available pairs that pass `keep`, in one pass of plain loops (as
    /// [`weighted_pick`] does over [`Self::options`], without the iterator adapters' cost).
    fn weighted_loop(
        &self,
        group: &'s TargetGroup,
        keep: &dyn Fn(&Choice<'s>) -> bool,
    ) -> Option<(usize, usize)> {
        let mut total = 0u64;
        let mut chosen = None;
        for (t, target) in group.targets.iter().enumerate() {
            let cluster = &self.snapshot.clusters[target.cluster];
            for (b, backend) in cluster.backends.iter().enumerate() {
                let health = self.health.get(backend.id);
                if !health.is_none_or(|h| available(h, self.now)) {
                    continue;
                }
                let weight = u64::from(target.weight) * u64::from(backend.weight);
                let o = Choice {
                    t,
                    b,
                    weight,
                    target,
                    health,
                };
                if weight == 0 || !keep(&o) {
                    continue;
                }
                total += weight;
                if next_random(self.rng) % total < weight {
                    chosen = Some((t, b));
                }
            }
        }
        chosen
    }

    /// Weighted random choice.
    fn weighted(&self, options: impl Iterator<Item = Choice<'s>> + Clone) -> Option<Choice<'s>> {
        weighted_pick(options.map(|o| (o, o.weight)), self.rng)
    }

    /// Power of two choices: two weighted picks (distinct when there are two), the lower
    /// `score` wins.
    fn two_choices(
        &self,
        options: impl Iterator<Item = Choice<'s>> + Clone,
        score: impl Fn(&Choice<'s>) -> f64,
    ) -> Option<Choice<'s>> {
        let first = self.weighted(options.clone())?;
        let others = options.filter(|o| (o.t, o.b) != (first.t, first.b));
        let Some(second) = self.weighted(others) else {
            return Some(first);
        };
        Some(if score(&second) < score(&first) {
            second
        } else {
            first
        })
    }

    /// The lowest `score`; ties broken by weight, at random.
    fn lowest(
        &self,
        options: impl Iterator<Item = Choice<'s>> + Clone,
        score: impl Fn(&Choice<'s>) -> f64,
    ) -> Option<Choice<'s>> {
        let best = options
            .clone()
            .map(|o| score(&o))
            .fold(f64::INFINITY, f64::min);
        self.weighted(options.filter(|o| score(o) <= best))
    }

    /// Input plus output price per million tokens of the model the target's upstream is sent;
    /// unpriced: last.
    fn price(&self, target: &RouteTarget) -> f64 {
        let cluster = &self.snapshot.clusters[target.cluster];
        let name = match &target.model {
            Some(m) => m.as_str(),
            None => cluster
                .model_map
                .get(self.model)
                .map_or(self.model, String::as_str),
        };
        self.snapshot
            .prices
            .get(name)
            .map_or(f64::MAX, |p| p.input + p.output)
    }
}

#[allow(clippy::too_many_arguments)] // each is one thing the decision reads
pub(crate) fn route<'s>(
    snapshot: &'s Snapshot,
    health: &'s HealthTable,
    model: &str,
    caller: Option<(KeyIdx, Option<usize>)>,
    needed_tokens: &dyn Fn() -> u64,
    session_of: &dyn Fn(&StickyRule, &str) -> Session,
    rng: &'s Cell<u64>,
) -> Result<Candidates<'s>, GatewayError> {
    let route_index = route_index(snapshot, model, caller)?;
    let route = &snapshot.routes[route_index];
    let now = crate::sys::time::mono_ms();
    // Estimated only for a route with a context window to fit in.
    let sized = route
        .groups
        .iter()
        .flat_map(|g| &g.targets)
        .any(|t| t.context_window.is_some());
    let needed_tokens = if sized { needed_tokens() } else { 0 };
    let picker = Picker {
        snapshot,
        health,
        rng,
        now,
        needed_tokens,
        model,
    };
    // A session's pinned backend first, while it is available, fits and is under the load cap.
    let sticky = route
        .sticky
        .as_ref()
        .map(|rule| (rule, session_of(rule, route.pattern.source())));
    // Pins live in wall-clock seconds; a route without stickiness reads no second clock.
    let now_s = if sticky.is_some() {
        crate::sys::time::unix_secs()
    } else {
        0
    };
    let pinned = sticky.and_then(|(_, session)| pinned_backend(&session, health, now_s));
    let pinned_walk = pinned.and_then(|identity| picker.find_pinned(route, identity));
    // No pin that holds: prefix affinity, when the rule has it.
    let prefix_walk = || {
        let (rule, session) = sticky?;
        picker.find_prefix(route, session.prefix?, rule.prefix?.load_factor)
    };
    let started = pinned_walk.or_else(prefix_walk).or_else(|| {
        route
            .groups
            .iter()
            .enumerate()
            .find_map(|(g, group)| Some((g, picker.start_walk(group)?)))
    });
    if let Some((g, mut walk)) = started {
        let group = &route.groups[g];
        let primary = make_target(
            snapshot,
            health,
            group,
            walk.first_target,
            walk.first_backend,
            model,
            rng,
            now,
        );
        // The walk goes on after the primary.
        walk.backend_step = 1;
        // A session not (or no longer) pinned here is pinned to the pick.
        if let (Some((rule, session)), None) = (sticky, pinned_walk) {
            pin_session(health, rule, &session, primary.backend.id, now_s);
        }
        let mut tried = [(usize::MAX, None); MAX_TRIED];
        tried[0] = (primary.backend.id, primary.mapped_model);
        return Ok(Candidates {
            snapshot,
            health,
            route,
            route_index,
            rng,
            now,
            needed_tokens,
            primary,
            sticky,
            start_group: g,
            group_step: 0,
            walk: Some(walk),
            tried,
            tried_len: 1,
        });
    }
    Err(nothing_could_take_it(
        snapshot,
        health,
        route,
        model,
        needed_tokens,
        now,
    ))
}

/// Which of the snapshot's routes serves `model` for `caller`: the first that matches (they are
/// stored most specific first), or 404.
pub(crate) fn route_index(
    snapshot: &Snapshot,
    model: &str,
    caller: Option<(KeyIdx, Option<usize>)>,
) -> Result<usize, GatewayError> {
    snapshot
        .routes
        .iter()
        .position(|r| r.pattern.matches(model) && r.scope.serves(caller))
        .ok_or_else(|| GatewayError::model_not_found(model))
}

/// The backend a session is pinned to: by its cookie, else by its id in the pin table.
fn pinned_backend(session: &Session, health: &HealthTable, now_s: u64) -> Option<u64> {
    session
        .cookie_backend
        .map(|(backend, _)| backend)
        .or_else(|| {
            let id = session.id?;
            health.pins()?.get(id, now_s)
        })
}

/// Pin a session that was not (or no longer) pinned to the backend picked for it.
fn pin_session(
    health: &HealthTable,
    rule: &StickyRule,
    session: &Session,
    backend: usize,
    now_s: u64,
) {
    if let (Some(id), Some(pins)) = (session.id, health.pins()) {
        let identity = health.identity(backend);
        pins.pin(id, identity, now_s + rule.ttl_secs, now_s);
    }
}

/// Why no target could take the request: no context window is large enough (the client's to
/// fix), or every backend is out.
fn nothing_could_take_it(
    snapshot: &Snapshot,
    health: &HealthTable,
    route: &Route,
    model: &str,
    needed_tokens: u64,
    now: u64,
) -> GatewayError {
    let largest = route
        .groups
        .iter()
        .flat_map(|g| &g.targets)
        .map(|t| t.context_window.unwrap_or(u64::MAX))
        .max()
        .unwrap_or(u64::MAX);
    if largest < needed_tokens {
        return GatewayError::context_length_exceeded(needed_tokens, largest);
    }
    if snapshot.saturation.is_some() && any_full(snapshot, health, route, needed_tokens, now) {
        return GatewayError::saturated();
    }
    GatewayError::upstream_unavailable(model, retry_after_secs(snapshot, health, route, now))
}

/// Whether some backend of the route that is up and fits the request is only full: then the
/// request may wait for room.
fn any_full(
    snapshot: &Snapshot,
    health: &HealthTable,
    route: &Route,
    needed_tokens: u64,
    now: u64,
) -> bool {
    route.groups.iter().flat_map(|g| &g.targets).any(|t| {
        t.context_window.is_none_or(|w| w >= needed_tokens)
            && snapshot.clusters[t.cluster].backends.iter().any(|b| {
                let h = health.get(b.id);
                h.is_some_and(|h| available(h, now)) && full(t, h, now, snapshot)
            })
    })
}

/// Bounded load (consistent hashing with bounded loads, Mirrokni et al.): a backend with
/// `in_flight` requests may take one more while that keeps it within its weight's share of
/// `load_factor` × the candidates' `total` in flight, this request included, rounded up — so no
/// backend is placed above `load_factor` × the (weighted) average + 1.
fn under_load_cap(in_flight: u64, weight: u64, total: u64, weights: u64, load_factor: f64) -> bool {
    if weights == 0 {
        return false;
    }
    let cap = load_factor * (total + 1) as f64 * weight as f64 / weights as f64;
    (in_flight + 1) as f64 <= cap.ceil()
}

/// Weighted rendezvous (highest-random-weight) hashing: the backend with the lowest score takes
/// `key`. Each backend's score depends on the key and its own identity only, so a backend
/// leaving moves only its own keys, every node agrees without sharing state, and a backend's
/// share of keys is its share of the weight.
fn rendezvous_score(key: u64, identity: u64, weight: u64) -> f64 {
    let h = mix(key ^ mix(identity));
    // Uniform in (0, 1), never 0.
    let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    -u.ln() / weight.max(1) as f64
}

/// splitmix64's finalizer.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Seconds until the first of the route's backends is back (at least 1).
fn retry_after_secs(snapshot: &Snapshot, health: &HealthTable, route: &Route, now: u64) -> u64 {
    let soonest = route
        .groups
        .iter()
        .flat_map(|g| g.targets.iter())
        .flat_map(|t| snapshot.clusters[t.cluster].backends.iter())
        .filter_map(|b| match health.get(b.id)?.availability(now) {
            Availability::Out { until } => Some(until),
            _ => None,
        })
        .min()
        .unwrap_or(now);
    soonest.saturating_sub(now).div_ceil(1000).max(1)
}

/// Weighted random choice among the cluster's available backends: its index; `None` when none
/// is available.
pub(crate) fn choose_backend(
    cluster: &Cluster,
    health: &HealthTable,
    rng: &Cell<u64>,
    now: u64,
) -> Option<usize> {
    let eligible = cluster
        .backends
        .iter()
        .enumerate()
        .filter(|(_, b)| backend_available(health, b, now))
        .map(|(i, b)| (i, u64::from(b.weight)));
    weighted_pick(eligible, rng)
}

/// Weighted random choice among `(item, weight)` pairs: the one weighted pick every choice in
/// routing makes (strategies, backends, credentials); `None` when the weights sum to 0.
fn weighted_pick<T>(items: impl Iterator<Item = (T, u64)>, rng: &Cell<u64>) -> Option<T> {
    // One pass (weighted reservoir sampling of one): each item replaces the choice with
    // probability weight / weight so far, which leaves item i chosen with probability
    // w_i / total. The items — availability and load checks — are computed once, not once to
    // sum and again to pick.
    let mut total = 0u64;
    let mut chosen = None;
    for (item, w) in items {
        if w == 0 {
            continue;
        }
        total += w;
        if next_random(rng) % total < w {
            chosen = Some(item);
        }
    }
    chosen
}

/// The next number of a per-worker generator ([`xorshift64star`](crate::sys::rand)).
pub(crate) fn next_random(state: &Cell<u64>) -> u64 {
    let mut x = state.get();
    let r = crate::sys::rand::xorshift64star(&mut x);
    state.set(x);
    r
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn snapshot() -> Snapshot {
        let text = r#"
            [clusters.a]
            backends = [{ base_url = "http://127.0.0.1:1/v1", weight = 3 }, { base_url = "http://127.0.0.1:2/v1", weight = 1 }]
            model_map = { "gpt-4o" = "real-4o" }
            [clusters.b]
            backends = [{ base_url = "http://127.0.0.1:3" }]
            [[routes]]
            model = "gpt-*"
            cluster = "b"
            [[routes]]
            model = "gpt-4o"
            cluster = "a"
            [[routes]]
            model = "gpt-4o-*"
            cluster = "a"
        "#;
        crate::config::load(text, &|_| None).unwrap()
    }

    fn table(s: &Snapshot) -> HealthTable {
        HealthTable::build(s, None)
    }

    #[test]
    fn most_specific_wins_and_maps() {
        let s = snapshot();
        let h = table(&s);
        let rng = Cell::new(1);
        let primary = |model| {
            route(&s, &h, model, None, &|| 0, &|_, _| Session::default(), &rng)
                .unwrap()
                .primary()
        };
        let t = primary("gpt-4o");
        assert_eq!(t.cluster.name, "a");
        assert_eq!(t.mapped_model, Some("real-4o"));
        assert_eq!(primary("gpt-4o-mini").cluster.name, "a");
        assert_eq!(primary("gpt-3.5").cluster.name, "b");
        assert_eq!(primary("gpt-3.5").mapped_model, None);
        let e = route(
            &s,
            &h,
            "claude",
            None,
            &|| 0,
            &|_, _| Session::default(),
            &rng,
        )
        .err()
        .unwrap();
        assert_eq!((e.status(), e.code()), (404, Some("model_not_found")));
    }

    #[test]
    fn weights_are_respected() {
        let s = snapshot();
        let h = table(&s);
        let rng = Cell::new(0x9e37_79b9_7f4a_7c15);
        let mut first = 0;
        for _ in 0..10_000 {
            if choose_backend(&s.clusters[0], &h, &rng, 1) == Some(0) {
                first += 1;
            }
        }
        assert!((7_000..8_000).contains(&first), "{first}");
    }

    fn walk(c: &mut Candidates<'_>, model: &str) -> Vec<usize> {
        std::iter::from_fn(|| c.next_fallback(model, None))
            .map(|t| t.backend.id)
            .collect()
    }

    #[test]
    fn candidates_are_the_pick_then_the_clusters_other_backends_in_order() {
        let s = snapshot();
        let h = table(&s);
        let ids = |c: &Cluster| c.backends.iter().map(|b| b.id).collect::<Vec<_>>();
        let a = ids(&s.clusters[0]);
        let mut seen_primaries = std::collections::BTreeSet::new();
        for seed in 1..64u64 {
            let rng = Cell::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let mut candidates = route(
                &s,
                &h,
                "gpt-4o",
                None,
                &|| 0,
                &|_, _| Session::default(),
                &rng,
            )
            .unwrap();
            let primary = candidates.primary();
            seen_primaries.insert(primary.backend.id);
            let rest = walk(&mut candidates.clone(), "gpt-4o");
            // Every backend exactly once, the primary first, then the others in rotation.
            let expected: Vec<_> = a
                .iter()
                .copied()
                .filter(|&id| id != primary.backend.id)
                .collect();
            assert_eq!(rest, expected, "seed {seed}");
            // Fallbacks keep the route's cluster and mapped model.
            let t = candidates.next_fallback("gpt-4o", None).unwrap();
            assert!(t.cluster_id == primary.cluster_id && t.mapped_model == Some("real-4o"));
        }
        // Both backends get to be primary (the weighted pick, not always the first).
        assert_eq!(seen_primaries.len(), 2);
        // A one-backend cluster has no fallback.
        let rng = Cell::new(7);
        assert!(route(
            &s,
            &h,
            "gpt-3.5",
            None,
            &|| 0,
            &|_, _| Session::default(),
            &rng
        )
        .unwrap()
        .next_fallback("gpt-3.5", None)
        .is_none());
    }

    fn grouped() -> Snapshot {
        let text = r#"
            [clusters.openai]
            backends = [{ base_url = "http://127.0.0.1:1/v1" }, { base_url = "http://127.0.0.1:2/v1" }]
            [clusters.azure]
            backends = [{ base_url = "http://127.0.0.1:3/v1" }]
            [clusters.local]
            backends = [{ base_url = "http://127.0.0.1:4/v1" }]
            model_map = { "gpt-4o" = "from-the-map" }
            [[routes]]
            model = "gpt-4o"
            [[routes.groups]]
            targets = [{ cluster = "openai", weight = 1 }, { cluster = "azure", model = "gpt-4o-eu", weight = 1 }]
            [[routes.groups]]
            targets = [{ cluster = "local", model = "llama-3.1-70b" }]
        "#;
        crate::config::load(text, &|_| None).unwrap()
    }

    /// The backend ids of a cluster, by name.
    fn backends_of(s: &Snapshot, name: &str) -> Vec<usize> {
        let c = s.clusters.iter().find(|c| c.name == name).unwrap();
        c.backends.iter().map(|b| b.id).collect()
    }

    #[test]
    fn groups_fall_back_in_order_with_each_targets_model() {
        let s = grouped();
        let h = table(&s);
        let (openai, azure, local) = (
            backends_of(&s, "openai"),
            backends_of(&s, "azure"),
            backends_of(&s, "local"),
        );
        let mut primaries = std::collections::BTreeSet::new();
        for seed in 1..64u64 {
            let rng = Cell::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let mut c = route(
                &s,
                &h,
                "gpt-4o",
                None,
                &|| 0,
                &|_, _| Session::default(),
                &rng,
            )
            .unwrap();
            let p = c.primary();
            primaries.insert(p.backend.id);
            let mut all = vec![p.backend.id];
            all.extend(walk(&mut c.clone(), "gpt-4o"));
            // Every backend once; a cluster's backends together; the self-hosted group last.
            let mut sorted = all.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, vec![0, 1, 2, 3], "seed {seed}");
            assert_eq!(all[3], local[0], "seed {seed}: {all:?}");
            let at = |id| all.iter().position(|&b| b == id).unwrap();
            assert_eq!(
                at(openai[0]).abs_diff(at(openai[1])),
                1,
                "seed {seed}: {all:?}"
            );
            // The models: azure's own, the first group's requested name, the local target's.
            while let Some(t) = c.next_fallback("gpt-4o", None) {
                let expected = match t.cluster.name.as_str() {
                    "azure" => Some("gpt-4o-eu"),
                    "local" => Some("llama-3.1-70b"),
                    _ => None,
                };
                assert_eq!(t.mapped_model, expected);
            }
        }
        let mut first_group = openai.clone();
        first_group.extend(&azure);
        assert_eq!(primaries, first_group.into_iter().collect());
    }

    #[test]
    fn backends_that_are_out_are_skipped_and_all_out_is_a_503_with_retry_after() {
        use crate::upstream::health::AttemptResult;
        let s = grouped();
        let h = table(&s);
        let (openai, azure, local) = (
            backends_of(&s, "openai"),
            backends_of(&s, "azure"),
            backends_of(&s, "local"),
        );
        let settings = s.routing;
        let now = crate::sys::time::mono_ms();
        // Both openai backends cool down for 2 s: azure is the primary, local the fallback.
        for &id in &openai {
            h.get(id).unwrap().record(
                AttemptResult::Cool {
                    ms: Some(2_000),
                    failed: false,
                },
                now,
                &settings,
            );
        }
        for seed in 1..16u64 {
            let rng = Cell::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let mut c = route(
                &s,
                &h,
                "gpt-4o",
                None,
                &|| 0,
                &|_, _| Session::default(),
                &rng,
            )
            .unwrap();
            assert_eq!(c.primary().backend.id, azure[0]);
            assert_eq!(walk(&mut c, "gpt-4o"), local);
        }
        // The rest open their breakers: nothing is left.
        for id in [azure[0], local[0]] {
            for _ in 0..settings.breaker.failures {
                h.get(id)
                    .unwrap()
                    .record(AttemptResult::Failed, now, &settings);
            }
        }
        let rng = Cell::new(3);
        let e = route(
            &s,
            &h,
            "gpt-4o",
            None,
            &|| 0,
            &|_, _| Session::default(),
            &rng,
        )
        .err()
        .unwrap();
        assert_eq!((e.status(), e.code()), (503, Some("upstream_unavailable")));
        // The soonest back is the cooled pair (2 s).
        assert_eq!(e.retry_after, Some(2));
    }

    #[test]
    fn the_same_backend_with_another_model_is_a_fallback_and_earlier_groups_come_back_round() {
        use crate::upstream::health::AttemptResult;
        let text = r#"
            [clusters.a]
            backends = [{ base_url = "http://127.0.0.1:1/v1" }]
            [clusters.b]
            backends = [{ base_url = "http://127.0.0.1:2/v1" }]
            [[routes]]
            model = "m"
            groups = [{ targets = [{ cluster = "a" }] }, { targets = [{ cluster = "a", model = "m-mini" }] }]
            [[routes]]
            model = "n"
            groups = [{ targets = [{ cluster = "a" }] }, { targets = [{ cluster = "b" }] }]
        "#;
        let s = crate::config::load(text, &|_| None).unwrap();
        let h = table(&s);
        let rng = Cell::new(5);
        // One backend, two models: the second group is a fallback of its own.
        let mut c = route(&s, &h, "m", None, &|| 0, &|_, _| Session::default(), &rng).unwrap();
        assert_eq!(c.primary().mapped_model, None);
        let next = c.next_fallback("m", None).unwrap();
        assert_eq!(
            (next.backend.id, next.mapped_model),
            (c.primary().backend.id, Some("m-mini"))
        );
        assert!(c.next_fallback("m", None).is_none());

        // The first group's backend is cooling: the walk starts in the second group, and comes
        // back round to the first once it is available again.
        let a = s.clusters.iter().find(|c| c.name == "a").unwrap().backends[0].id;
        let now = crate::sys::time::mono_ms();
        h.get(a).unwrap().record(
            AttemptResult::Cool {
                ms: Some(40),
                failed: false,
            },
            now,
            &s.routing,
        );
        let mut c = route(&s, &h, "n", None, &|| 0, &|_, _| Session::default(), &rng).unwrap();
        assert_ne!(c.primary().backend.id, a);
        #[allow(
            clippy::disallowed_methods,
            reason = "a unit test's own thread, not a worker: it waits out the cool-down"
        )]
        std::thread::sleep(std::time::Duration::from_millis(60));
        assert_eq!(c.next_fallback("n", None).map(|t| t.backend.id), Some(a));
        assert!(c.next_fallback("n", None).is_none());
    }

    fn prefix_pool(load_factor: f64) -> Snapshot {
        let text = format!(
            r#"
            [clusters.p]
            backends = [{{ base_url = "http://127.0.0.1:1/v1" }}, {{ base_url = "http://127.0.0.1:2/v1" }}, {{ base_url = "http://127.0.0.1:3/v1" }}]
            [[routes]]
            model = "m"
            cluster = "p"
            sticky = {{ prefix = {{ bytes = 64, load_factor = {load_factor:?} }} }}
        "#
        );
        crate::config::load(&text, &|_| None).unwrap()
    }

    fn by_prefix<'s>(s: &'s Snapshot, h: &'s HealthTable, rng: &'s Cell<u64>, key: u64) -> usize {
        let session = move |_: &StickyRule, _: &str| Session {
            prefix: Some(key),
            ..Session::default()
        };
        route(s, h, "m", None, &|| 0, &session, rng)
            .unwrap()
            .primary()
            .backend
            .id
    }

    #[test]
    fn a_prefix_goes_to_one_backend_and_prefixes_spread() {
        let s = prefix_pool(1.25);
        let h = table(&s);
        let mut per_backend = [0; 3];
        for key in 0..300u64 {
            let key = crate::upstream::health::fnv1a_extend(key, b"prefix");
            let first = by_prefix(&s, &h, &Cell::new(1), key);
            // Whatever the random state: the hash decides, not the strategy.
            for seed in 2..6u64 {
                assert_eq!(by_prefix(&s, &h, &Cell::new(seed), key), first);
            }
            per_backend[first] += 1;
        }
        assert!(per_backend.iter().all(|&n| n >= 70), "{per_backend:?}");
        // A backend that is out loses its prefixes to one other backend each, the rest stay.
        use crate::upstream::health::AttemptResult;
        let now = crate::sys::time::mono_ms();
        let keys: Vec<u64> = (0..100u64).map(|k| k.wrapping_mul(0x9e37_79b9)).collect();
        let before: Vec<usize> = keys
            .iter()
            .map(|&k| by_prefix(&s, &h, &Cell::new(1), k))
            .collect();
        h.get(0).unwrap().record(
            AttemptResult::Cool {
                ms: Some(60_000),
                failed: false,
            },
            now,
            &s.routing,
        );
        for (&k, &was) in keys.iter().zip(&before) {
            let now_at = by_prefix(&s, &h, &Cell::new(1), k);
            assert_ne!(now_at, 0);
            if was != 0 {
                assert_eq!(now_at, was, "only the out backend's prefixes move");
            }
            assert_eq!(by_prefix(&s, &h, &Cell::new(9), k), now_at);
        }
    }

    /// Place `steps` requests (90% one hot prefix), each held in flight; with `churn`, every
    /// other step first ends a random one. Calls `check(chosen, in_flight, total)` after each
    /// placement (in flight of each backend, after it).
    fn skewed_mix(
        s: &Snapshot,
        h: &HealthTable,
        steps: usize,
        churn: bool,
        mut check: impl FnMut(usize, [u64; 3], u64),
    ) {
        let rng = Cell::new(0x2545_f491_4f6c_dd1d);
        let mut guards = Vec::new();
        let now = crate::sys::time::mono_ms();
        for step in 0..steps {
            if churn && step % 2 == 0 && !guards.is_empty() {
                let i = (next_random(&rng) % guards.len() as u64) as usize;
                drop(guards.swap_remove(i));
            }
            let key = if next_random(&rng) % 10 < 9 {
                0xfeed
            } else {
                next_random(&rng)
            };
            let chosen = by_prefix(s, h, &rng, key);
            guards.push(h.get(chosen).unwrap().begin(now, &s.routing, None).unwrap());
            let in_flight: [u64; 3] =
                std::array::from_fn(|b| u64::from(h.get(b).unwrap().load.in_flight()));
            check(chosen, in_flight, in_flight.iter().sum());
        }
    }

    #[test]
    fn bounded_load_keeps_every_backend_within_c_times_the_average_plus_one() {
        let c = 1.25;
        let s = prefix_pool(c);
        let h = table(&s);
        let within = |n: u64, total: u64| n as f64 <= c * total as f64 / 3.0 + 1.0;
        // Growing only: no backend is ever above the bound.
        let mut hot = None;
        skewed_mix(&s, &h, 300, false, |_, in_flight, total| {
            for n in in_flight {
                assert!(within(n, total), "{in_flight:?}");
            }
            hot = Some(in_flight);
        });
        // The hot prefix's backend is the one at the cap: affinity was used up to it.
        let last = hot.unwrap();
        let max = *last.iter().max().unwrap();
        assert!(max as f64 >= c * 300.0 / 3.0 - 1.0, "{last:?}");
        drop(h);

        // With requests ending at random: each placement stays within the bound.
        let h = table(&s);
        skewed_mix(&s, &h, 2_000, true, |chosen, in_flight, total| {
            assert!(within(in_flight[chosen], total), "{chosen} {in_flight:?}");
        });

        // The same mix with the cap out of the way (c = 100) piles onto one backend: the bound
        // above is the rule's doing.
        let s = prefix_pool(100.0);
        let h = table(&s);
        let mut last = [0; 3];
        skewed_mix(&s, &h, 300, false, |_, in_flight, _| last = in_flight);
        assert!(*last.iter().max().unwrap() > 250, "{last:?}");
    }
}
