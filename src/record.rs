//! What is kept for a key: its state and the response the client first saw.
//!
//! A record is written in the same transaction as the handler's business rows. Only two
//! outcomes are ever committed: [`RecordState::Completed`] and
//! [`RecordState::FailedPermanent`], and both are replayed. `Processing` exists only inside the
//! claiming transaction, where concurrent duplicates wait on its unique-key lock; a retryable
//! failure (5xx, timeout, panic) rolls the claim back with everything else, so "failed,
//! retryable" is represented by the absence of a record and the next attempt executes afresh.

// The types are `pub` for the sealed backend's signatures; the module is private, so
// nothing here is reachable from outside the crate.
#![allow(unreachable_pub)]

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use crate::clock::Millis;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::scope::{Scope, ScopedKey};

/// The lifecycle state of a record.
///
/// Work that cannot run inside one transaction (a job calling other systems, say) is claimed
/// with a lease instead ([`Engine::run_leased`](crate::Engine::run_leased)): then `Processing`
/// is committed, carries a lease its holder renews, and may be taken over only once the lease
/// has run out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecordState {
    /// Claimed; the handler is running in the claiming transaction.
    Processing,
    /// The handler succeeded (2xx/3xx); the response is replayed.
    Completed,
    /// The handler gave a final refusal (e.g. 400, 403, 409 out of stock); its writes were undone
    /// and the response is replayed, so the client stops retrying.
    FailedPermanent,
}

impl RecordState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Processing => "processing",
            Self::Completed => "completed",
            Self::FailedPermanent => "failed_permanent",
        }
    }

    pub(crate) fn parse(value: &str) -> Result<Self, Error> {
        match value {
            "processing" => Ok(Self::Processing),
            "completed" => Ok(Self::Completed),
            "failed_permanent" => Ok(Self::FailedPermanent),
            other => Err(Error::CorruptRecord(format!("unknown state {other:?}"))),
        }
    }
}

/// The part of a response that is stored and replayed: status, chosen headers, body bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status the client first saw.
    pub(crate) status: StatusCode,
    /// The headers kept for replay, multi-valued ones intact and in order.
    pub(crate) headers: HeaderMap,
    /// The body, byte for byte.
    pub(crate) body: Bytes,
}

impl StoredResponse {
    /// Turns the stored parts back into a response.
    pub(crate) fn to_response(&self) -> http::Response<Bytes> {
        let mut response = http::Response::new(self.body.clone());
        *response.status_mut() = self.status;
        *response.headers_mut() = self.headers.clone();
        response
    }

    /// Serialises the headers as length-prefixed name/value pairs. Raw bytes, not JSON, because
    /// header values need not be UTF-8 and several values of one name must survive in order.
    pub(crate) fn encode_headers(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, value) in &self.headers {
            put_field(&mut out, name.as_str().as_bytes());
            put_field(&mut out, value.as_bytes());
        }
        out
    }

    /// The bytes a record keeps of this response, its encoded headers and its body, counted
    /// without encoding them.
    #[cfg(feature = "postgres")]
    pub(crate) fn stored_len(&self) -> usize {
        let headers: usize = self
            .headers
            .iter()
            .map(|(name, value)| 2 * FIELD_PREFIX + name.as_str().len() + value.len())
            .sum();
        headers + self.body.len()
    }

    pub(crate) fn decode_headers(mut bytes: &[u8]) -> Result<HeaderMap, Error> {
        let mut headers = HeaderMap::new();
        while !bytes.is_empty() {
            let name = take_field(&mut bytes)?;
            let value = take_field(&mut bytes)?;
            let name = HeaderName::from_bytes(name)
                .map_err(|_| Error::CorruptRecord("stored header name".into()))?;
            let value = HeaderValue::from_bytes(value)
                .map_err(|_| Error::CorruptRecord("stored header value".into()))?;
            headers.append(name, value);
        }
        Ok(headers)
    }
}

/// Every stored header field starts with its length, big-endian.
const FIELD_PREFIX: usize = 4;

fn put_field(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.extend_from_slice(bytes);
}

fn take_field<'a>(bytes: &mut &'a [u8]) -> Result<&'a [u8], Error> {
    let corrupt = || Error::CorruptRecord("truncated stored headers".into());
    let (len, rest) = bytes
        .split_first_chunk::<FIELD_PREFIX>()
        .ok_or_else(corrupt)?;
    let len = u32::from_be_bytes(*len) as usize;
    if rest.len() < len {
        return Err(corrupt());
    }
    let (field, rest) = rest.split_at(len);
    *bytes = rest;
    Ok(field)
}

/// A committed record as read back from the store.
#[derive(Debug, Clone)]
pub struct Record {
    pub(crate) state: RecordState,
    /// The fingerprint of the request that created it.
    pub(crate) fingerprint: Fingerprint,
    /// The stored response (absent while processing).
    pub(crate) response: Option<StoredResponse>,
    /// When it stops counting: from then on its key names a new intent.
    pub(crate) expires_at: Millis,
    /// For processing work held under a lease: when the lease runs out unless renewed.
    pub(crate) lease_expires_at: Option<Millis>,
}

impl Record {
    /// Whether the record has outlived its retention and its key now names a new intent.
    pub(crate) fn is_expired(&self, now: Millis) -> bool {
        self.expires_at <= now
    }
}

/// A record about to be written by a claim.
#[derive(Debug)]
pub struct NewRecord<'a> {
    /// The record's primary key.
    pub key: ScopedKey,
    /// The scope it belongs to, stored in clear for operators (the raw key is not).
    pub scope: &'a Scope,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// `Processing` for a claim before the handler runs, or a final state.
    pub state: RecordState,
    /// The response, for a final state.
    pub response: Option<&'a StoredResponse>,
    pub created_at: Millis,
    pub expires_at: Millis,
    /// For a claim that outlives its transaction: the holder and when its lease runs out.
    pub lease: Option<LeaseClaim>,
}

/// The holder of a lease and when the lease runs out unless renewed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseClaim {
    /// An id unique to one holder, so only it can renew, finish or release the claim.
    pub owner: [u8; 16],
    pub until: Millis,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_with_repeated_names_in_order() {
        let mut headers = HeaderMap::new();
        headers.append("location", HeaderValue::from_static("/orders/7"));
        headers.append("link", HeaderValue::from_static("</a>; rel=a"));
        headers.append("link", HeaderValue::from_static("</b>; rel=b"));
        headers.append(
            "x-bin",
            HeaderValue::from_bytes(b"\xfe\xff").expect("obs-text"),
        );
        let stored = StoredResponse {
            status: StatusCode::CREATED,
            headers: headers.clone(),
            body: Bytes::new(),
        };
        let decoded = StoredResponse::decode_headers(&stored.encode_headers()).expect("decodes");
        assert_eq!(decoded, headers);
        let links: Vec<_> = decoded.get_all("link").iter().collect();
        assert_eq!(links, ["</a>; rel=a", "</b>; rel=b"]);
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn stored_length_is_what_encoding_gives() {
        let mut headers = HeaderMap::new();
        headers.append("location", HeaderValue::from_static("/orders/7"));
        headers.append("link", HeaderValue::from_static("</a>; rel=a"));
        headers.append("link", HeaderValue::from_static("</b>; rel=b"));
        let stored = StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from_static(b"{\"id\":7}"),
        };
        assert_eq!(
            stored.stored_len(),
            stored.encode_headers().len() + stored.body.len()
        );
    }

    #[test]
    fn truncated_headers_are_a_corrupt_record_not_a_panic() {
        let mut headers = HeaderMap::new();
        headers.append("location", HeaderValue::from_static("/orders/7"));
        let stored = StoredResponse {
            status: StatusCode::OK,
            headers,
            body: Bytes::new(),
        };
        let bytes = stored.encode_headers();
        for cut in 1..bytes.len() {
            assert!(StoredResponse::decode_headers(&bytes[..cut]).is_err());
        }
    }
}
