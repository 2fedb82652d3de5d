//! The store's KV events for JS: each batch the core's [`EventHub`] hands out is converted and
//! queued to a JS callback (the `events()` iterator and the ZeroMQ publisher of
//! `lib/store-events.js` sit on it). The callback is weak: listening never keeps an idle
//! process alive.

use std::sync::Arc;

use napi::bindgen_prelude::*;
use napi::threadsafe_function::{ThreadsafeFunction, ThreadsafeFunctionCallMode};
use napi_derive::napi;
use prompt_store::events::{EventHub, KvEvent, Subscriber};

use crate::error::{err, Code, JsResult};

/// One event as the binding hands it to `lib/store-events.js`, which shapes it by `type`.
#[napi(object)]
pub struct StoreKvEvent {
    /// `'BlockStored' | 'BlockRemoved' | 'AllBlocksCleared'`.
    pub r#type: String,
    /// Chain keys, 64 hex digits each.
    pub block_hashes: Vec<String>,
    pub parent_block_hash: Option<String>,
    pub token_ids: Vec<i32>,
    pub block_size: u32,
    /// The tier: `'memory' | 'dir' | 'redis'` (empty for `AllBlocksCleared`).
    pub medium: String,
}

/// The JS callback: a batch of events, or an empty batch once the store is gone.
pub type EventsFn =
    ThreadsafeFunction<Vec<StoreKvEvent>, Unknown<'static>, Vec<StoreKvEvent>, Status, false, true>;

fn to_js(e: &KvEvent) -> StoreKvEvent {
    let hex = |keys: &[prompt_store::Key]| keys.iter().map(|k| k.hex()).collect();
    let mut out = StoreKvEvent {
        r#type: String::new(),
        block_hashes: Vec::new(),
        parent_block_hash: None,
        token_ids: Vec::new(),
        block_size: 0,
        medium: String::new(),
    };
    match e {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            medium,
        } => {
            out.r#type = "BlockStored".into();
            out.block_hashes = hex(block_hashes);
            out.parent_block_hash = parent_block_hash.map(|k| k.hex());
            out.token_ids = token_ids.clone();
            out.block_size = *block_size;
            out.medium = (*medium).into();
        }
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
        } => {
            out.r#type = "BlockRemoved".into();
            out.block_hashes = hex(block_hashes);
            out.medium = (*medium).into();
        }
        KvEvent::AllBlocksCleared => out.r#type = "AllBlocksCleared".into(),
    }
    out
}

/// The JS callback `value` as a threadsafe function; anything but a function is refused by name.
pub fn events_fn(value: Unknown<'_>) -> JsResult<EventsFn> {
    let ty = value
        .get_type()
        .map_err(|e| err(Code::InvalidArg, e.reason))?;
    if ty != ValueType::Function {
        return Err(err(
            Code::InvalidArg,
            format!("subscribeEvents: the callback must be a function, got {ty}"),
        ));
    }
    // SAFETY: `value` is a live function of the current call's env
    unsafe { EventsFn::from_napi_value(value.env(), value.raw()) }
        .map_err(|e| err(Code::InvalidArg, e.reason))
}

/// Subscribes `callback` to `hub`; returns the subscription's id.
pub fn subscribe(hub: &EventHub, callback: EventsFn) -> u64 {
    let f: Subscriber = Arc::new(move |events: &[KvEvent]| {
        // queued, never blocking the store's call; JS receives batches in this order
        callback.call(
            events.iter().map(to_js).collect(),
            ThreadsafeFunctionCallMode::NonBlocking,
        );
    });
    hub.subscribe(f)
}
