//! The protocol as a checked model: every interleaving of claims, commits, crashes, sends and
//! acknowledgements, up to a bound, explored by [stateright](https://docs.rs/stateright).
//!
//! Each model drives the crate's own decisions (the engine's, the dispatcher's and the
//! inbox's plain functions) and plays the database, the broker and the downstream as the crate
//! trusts them to behave; what it assumes of them is written beside each model and in the
//! guide's "What is proven". Every property has a broken variant of the decisions it guards, and
//! a test shows that the checker finds that variant's counterexample, so no property passes
//! only because it cannot fail.
//!
//! `cargo test --lib model` explores the default bounds; `MODEL_DEPTH=deep cargo test --release
//! --lib model -- --nocapture` explores the deeper ones and prints the state counts.

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::hash::Hash;
use std::time::Instant;

use stateright::{Checker, HasDiscoveries, Model};

mod http;
#[cfg(feature = "inbox")]
mod inbox;
#[cfg(feature = "outbox")]
mod outbox;

/// Whether the deeper bounds were asked for (`MODEL_DEPTH=deep`).
pub(super) fn deep() -> bool {
    std::env::var("MODEL_DEPTH").is_ok_and(|depth| depth == "deep")
}

/// Explores `model` in full and asserts that every property holds (and every `sometimes`
/// property has its example), printing what was explored.
pub(super) fn assert_holds<M>(name: &str, model: M)
where
    M: Model + Send + Sync + 'static,
    M::State: Debug + Hash + Send + Sync + Clone + PartialEq + 'static,
    M::Action: Debug + Send + Sync + Clone + PartialEq + 'static,
{
    let started = Instant::now();
    let checker = model.checker().threads(2).spawn_bfs().join();
    println!(
        "model {name}: {} states ({} unique), depth {}, {:.1?}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    checker.assert_properties();
}

/// Explores `model` and asserts that the checker finds a counterexample to `property`,
/// printing its trace up to the first state that breaks it (the checker keeps the last
/// counterexample its threads met, which may run on past that state).
pub(super) fn assert_breaks<M>(name: &str, model: M, property: &'static str)
where
    M: Model + Send + Sync + 'static,
    M::State: Debug + Hash + Send + Sync + Clone + PartialEq + 'static,
    M::Action: Debug + Send + Sync + Clone + PartialEq + 'static,
{
    // Breadth first, stopping at the first counterexample: the shortest, or near it.
    let checker = model
        .checker()
        .threads(2)
        .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([property])))
        .spawn_bfs()
        .join();
    let Some(path) = checker.discovery(property) else {
        panic!(
            "model {name}: no counterexample to {property:?} in {} states; the property cannot fail",
            checker.unique_state_count()
        );
    };
    let model = checker.model();
    let holds = model
        .properties()
        .into_iter()
        .find(|p| p.name == property)
        .map(|p| p.condition);
    println!("model {name}: counterexample to {property:?}:");
    for (state, action) in path.into_vec() {
        if holds.is_some_and(|holds| !holds(model, &state)) {
            break;
        }
        if let Some(action) = action {
            println!("  {action:?}");
        }
    }
}
