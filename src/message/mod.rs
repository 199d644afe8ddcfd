//! The outbox's messages as data: what a handler enqueues, the key the downstream sees, and what
//! the outbox keeps of each message.
//!
//! Plain values and their own rules, nothing that runs: below both the outbox, which enqueues,
//! reads and delivers them, and the backend, which stores them, so that neither has to import
//! the other to speak of a message. The public types are shown at their place in the
//! [`outbox`](crate::outbox) module.

mod downstream_key;
mod enqueued;
mod stored;

pub use downstream_key::{DownstreamKey, InvalidDownstreamKey};
pub use enqueued::Message;
pub(crate) use enqueued::valid_name;
pub use stored::{MessageId, OutboxRecord, Status};
