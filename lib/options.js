'use strict'
// The package's errors and option checks for its JS modules (the native binding has its own):
// an `Error` with a stable ERR_KV_* code, and options objects whose unknown keys are refused by
// name.

/** An `Error` with one of the package's stable codes. */
function codedError(code, message) {
  const e = new Error(message)
  e.code = code
  return e
}

/** `options` (undefined: {}) when it is a plain object; ERR_KV_INVALID_ARG otherwise. */
function optionsObject(options, who) {
  if (options === undefined) return {}
  if (options === null || typeof options !== 'object' || Array.isArray(options)) {
    throw codedError('ERR_KV_INVALID_ARG', `${who}: options must be an object, got ${options === null ? 'null' : typeof options}`)
  }
  return options
}

/** Refuses a value of `key` that is not of type `type` (undefined passes). */
function checkType(key, value, type, who) {
  if (value !== undefined && typeof value !== type) {
    throw codedError('ERR_KV_INVALID_ARG', `${who}: option '${key}' must be a ${type}, got ${typeof value}`)
  }
}

/** `options` when every key is one of `known` (name -> expected typeof); ERR_KV_INVALID_ARG naming the first that is not. */
function checkOptions(options, known, who) {
  const o = optionsObject(options, who)
  for (const [key, value] of Object.entries(o)) {
    if (!Object.hasOwn(known, key)) {
      throw codedError(
        'ERR_KV_INVALID_ARG',
        `${who}: unknown option '${key}' (the options are ${Object.keys(known).map((k) => `'${k}'`).join(', ')})`,
      )
    }
    checkType(key, value, known[key], who)
  }
  return o
}

module.exports = { codedError, optionsObject, checkType, checkOptions }
