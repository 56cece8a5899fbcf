//! Process definitions in Rust: a kind, a version and ordered steps with stable names.
//!
//! Each step is either **local** (its effect and its checkpoint commit in one transaction: the
//! step gets that transaction) or **external** (a call to a remote whose outcome can be unknown),
//! with what the remote supports ([`Remote`]), a [`RetryPolicy`], a timeout, and optionally a
//! [`Compensation`], which may be sensitive (it waits for an approver in manual_review).

use crate::error::StepError;
use crate::money::{CurrencyOf, MoneyField};
use crate::retry::RetryPolicy;
use serde_json::Value;
use sqlx::PgConnection;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

/// What a step's future resolves to.
pub type StepFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StepError>> + Send + 'a>>;

/// Evidence of a successful step: a reference (the local row, the remote's id) and an optional
/// small output that later steps read from [`StepContext::outputs`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Done {
    pub reference: String,
    pub output: Option<Value>,
}

impl Done {
    pub fn new(reference: impl Into<String>) -> Self {
        Self {
            reference: reference.into(),
            output: None,
        }
    }
    pub fn with_output(mut self, output: Value) -> Self {
        self.output = Some(output);
        self
    }
}

/// What a remote says when asked by operation id whether it acted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// It acted: this is the evidence.
    Found(Done),
    /// It has no record of the operation: calling again cannot duplicate it.
    NotFound,
    /// It could not say (lookup failed, ambiguous): the step goes to manual review.
    Inconclusive(String),
}

/// What a remote supports, which decides what happens when an outcome is unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Remote {
    /// The remote deduplicates by an idempotency key: every attempt sends the same key
    /// ([`StepContext::idempotency_key`]), so the call is simply retried.
    HonoursKey,
    /// The remote can be asked by operation id whether it acted: before any retry it is queried
    /// ([`ExternalStep::query`]); found = succeeded, not found = call again.
    Queryable,
    /// Neither: an unknown outcome goes to manual review.
    Neither,
}

impl Remote {
    pub fn as_str(self) -> &'static str {
        match self {
            Remote::HonoursKey => "honours_key",
            Remote::Queryable => "queryable",
            Remote::Neither => "none",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "honours_key" => Some(Remote::HonoursKey),
            "queryable" => Some(Remote::Queryable),
            "none" => Some(Remote::Neither),
            _ => None,
        }
    }
}

/// Whether a step row is a definition step, a compensation or an operator's resolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    Forward,
    Compensation,
    Resolution,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Forward => "forward",
            Role::Compensation => "compensation",
            Role::Resolution => "resolution",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "forward" => Some(Role::Forward),
            "compensation" => Some(Role::Compensation),
            "resolution" => Some(Role::Resolution),
            _ => None,
        }
    }
}

/// Everything a step may know about its process.
#[derive(Debug, Clone)]
pub struct StepContext {
    pub process_id: Uuid,
    pub kind: String,
    pub business_key: String,
    pub step: String,
    pub role: Role,
    /// 1 for the first attempt.
    pub attempt: i32,
    /// Stable across retries and workers: the reference a remote is queried by.
    pub operation_id: Uuid,
    /// For [`Remote::HonoursKey`] steps: the key to send on every attempt (the operation id).
    pub idempotency_key: Option<String>,
    /// The process input, as given to start (not redacted).
    pub input: Value,
    /// Outputs of the forward steps that succeeded, by step name.
    pub outputs: HashMap<String, Value>,
    /// Evidence references (remote or local, or an operator's evidence) of the forward steps
    /// that succeeded, by step name.
    pub references: HashMap<String, String>,
    /// For a compensation: the evidence of the step it undoes.
    pub compensates: Option<Done>,
}

/// A local step: its effect runs in `tx`, which also commits its checkpoint. An error rolls the
/// effect back.
pub trait LocalStep: Send + Sync {
    fn run<'a>(&'a self, ctx: &'a StepContext, tx: &'a mut PgConnection) -> StepFuture<'a, Done>;
}

impl<F> LocalStep for F
where
    F: for<'a> Fn(&'a StepContext, &'a mut PgConnection) -> StepFuture<'a, Done> + Send + Sync,
{
    fn run<'a>(&'a self, ctx: &'a StepContext, tx: &'a mut PgConnection) -> StepFuture<'a, Done> {
        self(ctx, tx)
    }
}

/// An external step: a call to a remote (outside any transaction of ours).
///
/// The attempt is committed before [`call`](Self::call) runs. A timeout of the call counts as an
/// unknown outcome, never as a failure.
pub trait ExternalStep: Send + Sync {
    /// Performs the operation. For [`Remote::HonoursKey`], send `ctx.idempotency_key`; always
    /// send `ctx.operation_id` as the reference the remote can be queried by.
    fn call<'a>(&'a self, ctx: &'a StepContext) -> StepFuture<'a, Done>;

    /// For [`Remote::Queryable`]: asks the remote whether the operation `ctx.operation_id` took
    /// place. The default cannot tell.
    fn query<'a>(&'a self, ctx: &'a StepContext) -> StepFuture<'a, Lookup> {
        let _ = ctx;
        Box::pin(async { Ok(Lookup::Inconclusive("this step has no status query".into())) })
    }
}

/// A step that waits for an external event (a webhook, a message), correlated by a key it names.
///
/// When the process reaches the step, the worker computes [`key`](Self::key) and looks for an
/// event stored under it by [`crate::signal()`] (an event that came early is kept there). If there
/// is none, the process parks (no lease, no connection: a `waiting` row due at the deadline)
/// until a signal for the key wakes it or the deadline passes. At the deadline a
/// [`Remote::Queryable`] remote is asked ([`query`](Self::query)), with the step's retry policy
/// between queries; [`Remote::Neither`] goes to manual review.
pub trait WaitStep: Send + Sync {
    /// The correlation key of the awaited event, from the input and earlier steps' outputs
    /// (e.g. `charge:<id>` from the charge step's output). An error fails the step.
    fn key(&self, ctx: &StepContext) -> Result<String, StepError>;

    /// An outcome already known without the event (e.g. a remote that answered at once): taken
    /// as [`received`](Self::received)'s would be, without waiting. The default knows none.
    fn already(&self, ctx: &StepContext) -> Option<Result<Done, StepError>> {
        let _ = ctx;
        None
    }

    /// What the event means: success with its evidence, or an error classified as for calls
    /// (e.g. a declined charge is permanent). The default takes any event as success.
    fn received(&self, ctx: &StepContext, key: &str, payload: &Value) -> Result<Done, StepError> {
        let _ = ctx;
        Ok(Done::new(key).with_output(payload.clone()))
    }

    /// At the deadline, for [`Remote::Queryable`]: asks the remote for the outcome.
    /// `Found` succeeds the step; an error is retried by the step's policy (a transient or
    /// unknown one, e.g. "still pending") or fails it (permanent); `NotFound` and `Inconclusive`
    /// go to manual review (absence is never taken as an outcome).
    fn query<'a>(&'a self, ctx: &'a StepContext, key: &'a str) -> StepFuture<'a, Lookup> {
        let _ = (ctx, key);
        Box::pin(async { Ok(Lookup::Inconclusive("this wait has no status query".into())) })
    }
}

/// A durable timer: the process continues at the time [`at`](Self::at) names (stored with the
/// step when the process reaches it, so it survives worker restarts).
pub trait TimerStep: Send + Sync {
    fn at(&self, ctx: &StepContext) -> Result<chrono::DateTime<chrono::Utc>, StepError>;
}

impl<F> TimerStep for F
where
    F: Fn(&StepContext) -> Result<chrono::DateTime<chrono::Utc>, StepError> + Send + Sync,
{
    fn at(&self, ctx: &StepContext) -> Result<chrono::DateTime<chrono::Utc>, StepError> {
        self(ctx)
    }
}

/// How a step (or a compensation) is carried out.
#[derive(Clone)]
pub enum Action {
    Local(Arc<dyn LocalStep>),
    External {
        remote: Remote,
        call: Arc<dyn ExternalStep>,
    },
    /// Waits for an event by key until `deadline` (from when the wait begins), then asks the
    /// remote if it is [`Remote::Queryable`] or goes to manual review.
    Wait {
        remote: Remote,
        deadline: Duration,
        wait: Arc<dyn WaitStep>,
    },
    /// Continues at a time.
    Timer(Arc<dyn TimerStep>),
}

impl Action {
    pub fn local(step: impl LocalStep + 'static) -> Self {
        Action::Local(Arc::new(step))
    }
    pub fn external(remote: Remote, step: impl ExternalStep + 'static) -> Self {
        Action::External {
            remote,
            call: Arc::new(step),
        }
    }
    /// Waits for an event (see [`WaitStep`]); a remote that honours keys cannot be asked, so it
    /// is treated as [`Remote::Neither`].
    pub fn wait(remote: Remote, deadline: Duration, step: impl WaitStep + 'static) -> Self {
        let remote = match remote {
            Remote::HonoursKey => Remote::Neither,
            r => r,
        };
        Action::Wait {
            remote,
            deadline,
            wait: Arc::new(step),
        }
    }
    pub fn timer(step: impl TimerStep + 'static) -> Self {
        Action::Timer(Arc::new(step))
    }
    pub fn execution(&self) -> &'static str {
        match self {
            Action::Local(_) => "local",
            Action::External { .. } => "external",
            Action::Wait { .. } => "wait",
            Action::Timer(_) => "timer",
        }
    }
    pub fn remote(&self) -> Option<Remote> {
        match self {
            Action::Local(_) | Action::Timer(_) => None,
            Action::External { remote, .. } | Action::Wait { remote, .. } => Some(*remote),
        }
    }
}

impl std::fmt::Debug for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Action::Local(_) => f.write_str("Local"),
            Action::External { remote, .. } => write!(f, "External({})", remote.as_str()),
            Action::Wait {
                remote, deadline, ..
            } => write!(f, "Wait({}, {deadline:?})", remote.as_str()),
            Action::Timer(_) => f.write_str("Timer"),
        }
    }
}

/// Undoes a step's effect; runs as a new step linked to the original, in reverse order.
#[derive(Debug, Clone)]
pub struct Compensation {
    pub action: Action,
    /// Needs an approver before it runs (a refund, a customer-visible undo).
    pub sensitive: bool,
    pub retry: RetryPolicy,
    pub timeout: Duration,
    /// What it does in business words ("refund", "release"), so a person reads the refund as a
    /// refund and not as the step it undoes; stored with the compensation step.
    pub label: Option<String>,
    /// The remote it calls, as its step's ([`Step::needs`]).
    pub dependency: Option<breaker::Dependency>,
}

/// One step of a definition.
#[derive(Debug, Clone)]
pub struct Step {
    /// Stable name: stored with every row, never reuse it for a different effect.
    pub name: String,
    pub action: Action,
    pub retry: RetryPolicy,
    /// Limit of one attempt (external call or local transaction); past it the outcome of an
    /// external call is unknown.
    pub timeout: Duration,
    pub compensation: Option<Compensation>,
    /// The remote an external step (and its compensation) calls ([`Step::needs`]).
    pub dependency: Option<breaker::Dependency>,
}

impl Step {
    pub fn local(name: impl Into<String>, step: impl LocalStep + 'static) -> Self {
        Self::new(name, Action::local(step))
    }
    pub fn external(
        name: impl Into<String>,
        remote: Remote,
        step: impl ExternalStep + 'static,
    ) -> Self {
        Self::new(name, Action::external(remote, step))
    }
    /// Waits for an event correlated by `step`'s key, at most `deadline` from when the process
    /// reaches it; then queries a [`Remote::Queryable`] remote or goes to manual review.
    pub fn wait(
        name: impl Into<String>,
        remote: Remote,
        deadline: Duration,
        step: impl WaitStep + 'static,
    ) -> Self {
        Self::new(name, Action::wait(remote, deadline, step))
    }
    /// Continues at the time `step` names ("continue at T"), durably.
    pub fn timer(name: impl Into<String>, step: impl TimerStep + 'static) -> Self {
        Self::new(name, Action::timer(step))
    }
    pub fn new(name: impl Into<String>, action: Action) -> Self {
        Self {
            name: name.into(),
            action,
            retry: RetryPolicy::default(),
            timeout: Duration::from_secs(10),
            compensation: None,
            dependency: None,
        }
    }
    /// The step (and its compensation) calls `dependency`: before each call the worker asks its
    /// shared circuit and limits, and while the remote is down the step waits for it (no attempt
    /// spent, the remote not called) and is woken, oldest first at the dependency's resume rate,
    /// when it may be called again.
    pub fn needs(mut self, dependency: breaker::Dependency) -> Self {
        if let Some(c) = self.compensation.as_mut() {
            c.dependency = Some(dependency.clone());
        }
        self.dependency = Some(dependency);
        self
    }
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
    /// Compensated by `action` (automatically, in reverse order, after a later permanent failure).
    pub fn compensate(mut self, action: Action) -> Self {
        self.compensation = Some(Compensation {
            action,
            sensitive: false,
            retry: RetryPolicy::default(),
            timeout: self.timeout,
            label: None,
            dependency: self.dependency.clone(),
        });
        self
    }
    /// [`Step::compensate`], named for what it does (`"release"`): the label is stored with the
    /// compensation step and shown instead of "undo <step>" (1 to 100 bytes; longer is cut).
    pub fn compensate_as(self, label: impl Into<String>, action: Action) -> Self {
        self.compensate(action).labelled(label)
    }
    /// [`Step::compensate_sensitive`], named for what it does (`"refund"`).
    pub fn compensate_sensitive_as(self, label: impl Into<String>, action: Action) -> Self {
        self.compensate_sensitive(action).labelled(label)
    }
    fn labelled(mut self, label: impl Into<String>) -> Self {
        let label = crate::redact::truncate(label.into().trim(), 100);
        if let Some(c) = self.compensation.as_mut() {
            c.label = Some(label).filter(|l| !l.is_empty());
        }
        self
    }
    /// Compensated by `action`, but only after an approver confirms (it waits in manual_review).
    pub fn compensate_sensitive(mut self, action: Action) -> Self {
        self.compensation = Some(Compensation {
            action,
            sensitive: true,
            retry: RetryPolicy::default(),
            timeout: self.timeout,
            label: None,
            dependency: self.dependency.clone(),
        });
        self
    }
}

/// Why a definition was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DefinitionError {
    #[error("a definition needs a kind of 1 to 200 bytes")]
    Kind,
    #[error("definition versions start at 1")]
    Version,
    #[error("a definition needs at least one step")]
    NoSteps,
    #[error("step name {0:?} is empty, too long or used twice")]
    StepName(String),
    #[error(
        "money field {0:?}: its amount and currency paths must not be empty, and its code must be an ISO 4217 currency with a decimal exponent (EUR, JPY, BHD)"
    )]
    Money(String),
    #[error("money field {0:?} is also declared redacted: an amount shown is not redacted")]
    MoneyRedacted(String),
}

/// A process definition: kind, version, ordered steps.
#[derive(Debug, Clone)]
pub struct Definition {
    kind: String,
    version: i32,
    steps: Vec<Step>,
    redacted: Vec<String>,
    deadline: Option<Duration>,
    fair_key: Option<String>,
    money: Vec<MoneyField>,
}

impl Definition {
    pub fn new(kind: impl Into<String>, version: i32) -> Self {
        Self {
            kind: kind.into(),
            version,
            steps: Vec::new(),
            redacted: Vec::new(),
            deadline: None,
            fair_key: None,
            money: Vec::new(),
        }
    }
    pub fn step(mut self, step: Step) -> Self {
        self.steps.push(step);
        self
    }
    /// Input fields (top-level or dotted paths, e.g. `card.number`) shown as `"[redacted]"`.
    pub fn redact(mut self, field: impl Into<String>) -> Self {
        self.redacted.push(field.into());
        self
    }
    /// The input field `amount` (top-level or a dotted path) holds money: whole minor units
    /// (cents) of the currency whose ISO 4217 code is in the input field `currency_field`. The
    /// console, its cards and the CLI then show it in major units ("63.96 EUR", "500 JPY").
    pub fn money(mut self, amount: impl Into<String>, currency_field: impl Into<String>) -> Self {
        self.money.push(MoneyField {
            amount: amount.into(),
            currency: CurrencyOf::Field(currency_field.into()),
        });
        self
    }
    /// Like [`Self::money`], for an amount always in the currency `code` (ISO 4217).
    pub fn money_in(mut self, amount: impl Into<String>, code: impl Into<String>) -> Self {
        self.money.push(MoneyField {
            amount: amount.into(),
            currency: CurrencyOf::Code(code.into()),
        });
        self
    }
    /// The input fields declared money ([`Self::money`]).
    pub fn money_fields(&self) -> &[MoneyField] {
        &self.money
    }
    /// Overall deadline of a process, from its start.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }
    /// The input field (top-level or a dotted path, e.g. `merchant.id`) that says whose work a
    /// process is: a tenant, a merchant. A worker with a fair share
    /// ([`crate::WorkerConfig::fair_share`]) claims the due processes of each key in turn, by
    /// weight, so one key's burst cannot starve the others. A string or a number; a process whose
    /// input lacks it shares the group of processes without a key.
    pub fn fair_key(mut self, field: impl Into<String>) -> Self {
        self.fair_key = Some(field.into());
        self
    }
    /// The fair key of a process with `input` (see [`Self::fair_key`]); a key longer than 200
    /// bytes is cut there (at a character boundary).
    pub fn fair_key_of(&self, input: &Value) -> Option<String> {
        let field = self.fair_key.as_deref()?;
        let value = field.split('.').try_fold(input, |v, part| v.get(part))?;
        let mut key = match value {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            _ => return None,
        };
        if key.len() > 200 {
            let cut = (0..=200)
                .rev()
                .find(|&i| key.is_char_boundary(i))
                .unwrap_or(0);
            key.truncate(cut);
        }
        (!key.is_empty()).then_some(key)
    }
    /// Checks names and shape; [`crate::Registry::with`] calls it.
    pub fn validate(&self) -> Result<(), DefinitionError> {
        if self.kind.is_empty() || self.kind.len() > 200 {
            return Err(DefinitionError::Kind);
        }
        if self.version < 1 {
            return Err(DefinitionError::Version);
        }
        if self.steps.is_empty() {
            return Err(DefinitionError::NoSteps);
        }
        for (i, s) in self.steps.iter().enumerate() {
            if s.name.is_empty()
                || s.name.len() > 200
                || self.steps[..i].iter().any(|o| o.name == s.name)
            {
                return Err(DefinitionError::StepName(s.name.clone()));
            }
        }
        for m in &self.money {
            let currency_ok = match &m.currency {
                CurrencyOf::Field(path) => !path.is_empty(),
                CurrencyOf::Code(code) => shared::money::exponent(code).is_some(),
            };
            if m.amount.is_empty() || !currency_ok {
                return Err(DefinitionError::Money(m.amount.clone()));
            }
            if self
                .redacted
                .iter()
                .any(|r| *r == m.amount || matches!(&m.currency, CurrencyOf::Field(c) if c == r))
            {
                return Err(DefinitionError::MoneyRedacted(m.amount.clone()));
            }
        }
        Ok(())
    }
    pub fn kind(&self) -> &str {
        &self.kind
    }
    pub fn version(&self) -> i32 {
        self.version
    }
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }
    pub fn redacted_fields(&self) -> &[String] {
        &self.redacted
    }
    pub fn deadline_duration(&self) -> Option<Duration> {
        self.deadline
    }
    pub fn step_named(&self, name: &str) -> Option<&Step> {
        self.steps.iter().find(|s| s.name == name)
    }
}

/// The definitions a worker knows, by (kind, version).
#[derive(Debug, Clone, Default)]
pub struct Registry {
    definitions: HashMap<(String, i32), Arc<Definition>>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }
    /// Adds a definition (a worker can know several versions of one kind).
    pub fn with(mut self, definition: Definition) -> Result<Self, DefinitionError> {
        definition.validate()?;
        self.definitions.insert(
            (definition.kind.clone(), definition.version),
            Arc::new(definition),
        );
        Ok(self)
    }
    pub fn get(&self, kind: &str, version: i32) -> Option<&Arc<Definition>> {
        self.definitions.get(&(kind.to_string(), version))
    }
    /// Every dependency a step or compensation of a definition names, once by name.
    pub fn dependencies(&self) -> Vec<breaker::Dependency> {
        let mut seen = std::collections::BTreeMap::new();
        for d in self.definitions.values() {
            for s in d.steps() {
                let comp = s.compensation.as_ref().and_then(|c| c.dependency.as_ref());
                for dep in s.dependency.iter().chain(comp) {
                    seen.entry(dep.name().to_string())
                        .or_insert_with(|| dep.clone());
                }
            }
        }
        seen.into_values().collect()
    }

    /// (kinds, versions) as parallel arrays, for the claim query.
    pub fn known(&self) -> (Vec<String>, Vec<i32>) {
        self.definitions.keys().cloned().unzip()
    }
    pub fn is_empty(&self) -> bool {
        self.definitions.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noop<'a>(_: &'a StepContext, _: &'a mut PgConnection) -> StepFuture<'a, Done> {
        Box::pin(async { Ok(Done::new("done")) })
    }

    fn one_step() -> Definition {
        Definition::new("k", 1).step(Step::local("s", noop))
    }

    #[test]
    fn money_fields_need_a_currency_iso_knows_and_are_never_also_redacted() {
        assert_eq!(one_step().money("amount", "currency").validate(), Ok(()));
        assert_eq!(one_step().money_in("fee", "JPY").validate(), Ok(()));
        assert_eq!(
            one_step().money_in("fee", "XYZ").validate(),
            Err(DefinitionError::Money("fee".into()))
        );
        assert_eq!(
            one_step().money("", "currency").validate(),
            Err(DefinitionError::Money("".into()))
        );
        assert_eq!(
            one_step()
                .money("amount", "currency")
                .redact("amount")
                .validate(),
            Err(DefinitionError::MoneyRedacted("amount".into()))
        );
    }
}
